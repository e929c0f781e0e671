"""A Python grpcio client calling every RPC of a running rebound-sidecar.

Stubs are generated from proto/rebound/v1 at test time (grpc_tools.protoc into a temporary
directory), so this proves the .proto files are what the server speaks. Reflection is
exercised twice: listing services, and calling Decide with message classes built only
from the descriptors the server returns, as grpcurl would.

Run by sidecar/tests/python_client.rs, which starts the sidecar with a known policy file:
    python3 client_test.py --target 127.0.0.1:PORT --proto-root ../../../proto
"""

import argparse
import importlib
import sys
import tempfile
import unittest

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

TARGET = ""
PROTO_ROOT = ""
pb = None
pb_grpc = None


def generate_stubs(proto_root: str, out_dir: str) -> None:
    from grpc_tools import protoc

    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            "rebound/v1/advisor.proto",
        ]
    )
    if code != 0:
        raise RuntimeError(f"grpc_tools.protoc failed with exit code {code}")
    sys.path.insert(0, out_dir)


class SidecarTest(unittest.TestCase):
    def setUp(self):
        # grpc-core sends the socket path as :authority over unix sockets, which the
        # server's HTTP/2 stack rejects as malformed; "localhost" is the usual convention.
        options = [("grpc.default_authority", "localhost")] if TARGET.startswith("unix:") else []
        self.channel = grpc.insecure_channel(TARGET, options=options)
        self.advisor = pb_grpc.RetryAdvisorStub(self.channel)

    def tearDown(self):
        self.channel.close()

    def decide(self, **fields):
        return self.advisor.Decide(pb.DecideRequest(**fields), timeout=5)

    def test_health_check(self):
        health = health_pb2_grpc.HealthStub(self.channel)
        for service in ["", "rebound.v1.RetryAdvisor"]:
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            self.assertEqual(reply.status, health_pb2.HealthCheckResponse.SERVING, service)
        with self.assertRaises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        self.assertEqual(err.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_decide_retry(self):
        reply = self.decide(queue="webhooks", attempt=1, job_id="job-42")
        self.assertEqual(reply.decision, pb.DECISION_RETRY)
        self.assertLessEqual(reply.delay_ms, 2_000, "retry 1 waits at most the base")
        self.assertEqual(reply.disposition, pb.DISPOSITION_UNSPECIFIED)
        self.assertEqual(reply.policy.name, "webhooks")
        self.assertEqual(reply.policy.namespace, "demo")
        self.assertTrue(reply.policy.config_hash.startswith("sha256:"))
        again = self.decide(queue="webhooks", attempt=1, job_id="job-42")
        self.assertEqual(again.delay_ms, reply.delay_ms, "same job, same answer")

    def test_decide_give_up(self):
        reply = self.decide(queue="webhooks", attempt=5, job_id="job-42")
        self.assertEqual(reply.decision, pb.DECISION_GIVE_UP)
        self.assertEqual(reply.disposition, pb.DISPOSITION_DEAD_LETTER)
        self.assertEqual(reply.dead_letter_queue, "webhooks-dead")
        self.assertEqual(reply.reason, pb.GIVE_UP_REASON_MAX_ATTEMPTS)
        self.assertIn("maxAttempts", reply.reason_message)
        fatal = self.decide(queue="webhooks", attempt=1, error_class="InvalidSignature")
        self.assertEqual(fatal.reason, pb.GIVE_UP_REASON_NON_RETRYABLE)

    def test_decide_errors(self):
        cases = [
            (dict(queue="webhooks", attempt=0), grpc.StatusCode.INVALID_ARGUMENT, "attempt"),
            (dict(queue="", attempt=1), grpc.StatusCode.INVALID_ARGUMENT, "queue"),
            (dict(queue="x" * 300, attempt=1), grpc.StatusCode.INVALID_ARGUMENT, "253"),
            (dict(queue="nobody", attempt=1), grpc.StatusCode.NOT_FOUND, '"nobody"'),
        ]
        for fields, code, text in cases:
            with self.assertRaises(grpc.RpcError, msg=str(fields)[:60]) as err:
                self.decide(**fields)
            self.assertEqual(err.exception.code(), code)
            self.assertIn(text, err.exception.details())

    def test_decide_batch(self):
        request = pb.DecideBatchRequest(
            requests=[
                pb.DecideRequest(queue="webhooks", attempt=1, job_id="a"),
                pb.DecideRequest(queue="nobody", attempt=1),
                pb.DecideRequest(queue="webhooks", attempt=5),
            ]
        )
        reply = self.advisor.DecideBatch(request, timeout=5)
        self.assertEqual(len(reply.results), 3)
        self.assertEqual(reply.results[0].WhichOneof("result"), "decision")
        self.assertEqual(reply.results[0].decision.decision, pb.DECISION_RETRY)
        self.assertEqual(reply.results[1].WhichOneof("result"), "error")
        self.assertEqual(reply.results[1].error.code, grpc.StatusCode.NOT_FOUND.value[0])
        self.assertEqual(reply.results[2].decision.decision, pb.DECISION_GIVE_UP)

    def test_get_policy(self):
        reply = self.advisor.GetPolicy(pb.GetPolicyRequest(queue="webhooks"), timeout=5)
        self.assertEqual(reply.policy.name, "webhooks")
        p = reply.resolved
        self.assertEqual(p.strategy, pb.STRATEGY_EXPONENTIAL)
        self.assertEqual(p.base_ms, 2_000)
        self.assertEqual(p.cap_ms, 60_000)
        self.assertEqual(p.jitter, pb.JITTER_FULL)
        self.assertEqual(p.max_attempts, 5)
        self.assertEqual(list(p.non_retryable_errors), ["InvalidSignature"])
        self.assertEqual(p.terminal, pb.DISPOSITION_DEAD_LETTER)
        self.assertEqual(p.dead_letter_queue, "webhooks-dead")
        # A glob pattern answers the queues it matches.
        other = self.advisor.GetPolicy(pb.GetPolicyRequest(queue="reports.daily"), timeout=5)
        self.assertEqual(other.policy.name, "reports")

    def reflect(self, method, request):
        call = self.channel.stream_stream(
            method,
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        return list(call(iter([request]), timeout=5))

    def test_reflection_lists_services_v1_and_v1alpha(self):
        for version in ["v1alpha", "v1"]:
            method = f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
            [reply] = self.reflect(method, reflection_pb2.ServerReflectionRequest(list_services=""))
            names = {s.name for s in reply.list_services_response.service}
            self.assertIn("rebound.v1.RetryAdvisor", names, version)
            self.assertIn("grpc.health.v1.Health", names, version)

    def test_reflection_alone_is_enough_to_call_decide(self):
        stub = reflection_pb2_grpc.ServerReflectionStub(self.channel)
        replies = list(
            stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="rebound.v1.RetryAdvisor")]),
                timeout=5,
            )
        )
        protos = replies[0].file_descriptor_response.file_descriptor_proto
        files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in protos]
        service = next(s for f in files for s in f.service if s.name == "RetryAdvisor")
        self.assertEqual([m.name for m in service.method], ["Decide", "DecideBatch", "GetPolicy"])

        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(self.channel))
        request_cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("rebound.v1.DecideRequest"))
        response_cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("rebound.v1.DecideResponse"))
        decide = self.channel.unary_unary(
            "/rebound.v1.RetryAdvisor/Decide",
            request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString,
        )
        reply = decide(request_cls(queue="webhooks", attempt=5), timeout=5)
        self.assertEqual(reply.dead_letter_queue, "webhooks-dead")


def main() -> int:
    global TARGET, PROTO_ROOT, pb, pb_grpc
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True, help="host:port or unix:/path")
    parser.add_argument("--proto-root", required=True)
    args = parser.parse_args()
    TARGET, PROTO_ROOT = args.target, args.proto_root
    with tempfile.TemporaryDirectory() as out_dir:
        generate_stubs(PROTO_ROOT, out_dir)
        pb = importlib.import_module("rebound.v1.advisor_pb2")
        pb_grpc = importlib.import_module("rebound.v1.advisor_pb2_grpc")
        suite = unittest.defaultTestLoader.loadTestsFromTestCase(SidecarTest)
        result = unittest.TextTestRunner(verbosity=2).run(suite)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
