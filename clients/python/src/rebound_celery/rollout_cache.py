"""GetPolicy's rollout as the fallback keeps it: prepared once when the policy is cached, so
the fallback picks, per job, the revision the sidecar picks."""

from .assign import CANARY, PreparedRollout, arm_prepared
from .client import resolved_from_wire
from .decide import PreparedPolicy


class CachedRollout:
    """A rollout prepared under the policy's identity: the canary shares the stable
    revision's jitter seed, as in the sidecar."""

    __slots__ = ("assign", "canary", "revision", "stable_revision")

    def __init__(self, wire, identity):
        steps = [{"weight": s.weight, "startUnixMs": s.start_unix_ms} for s in wire.steps]
        self.assign = PreparedRollout(wire.revision, steps)
        self.canary = PreparedPolicy(resolved_from_wire(wire.canary), identity)
        self.revision = wire.revision
        self.stable_revision = wire.stable_revision


def prepare_rollout(res, identity):
    """The rollout of a GetPolicyResponse, or None when the policy is not in rollout."""
    if not res.HasField("rollout") or not res.rollout.HasField("canary"):
        return None
    return CachedRollout(res.rollout, identity)


def pick(stable, rollout, job_id, first_failure_unix_ms, now_unix_ms):
    """``(prepared, revision)``: the revision answering the job ('' without a rollout)."""
    if rollout is None:
        return stable, ""
    if arm_prepared(rollout.assign, job_id, first_failure_unix_ms, now_unix_ms)["arm"] == CANARY:
        return rollout.canary, rollout.revision
    return stable, rollout.stable_revision
