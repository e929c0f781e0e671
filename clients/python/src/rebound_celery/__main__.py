"""``python -m rebound_celery replay APP QUEUE [--key KEY]``: replays the dead letters
waiting on QUEUE (APP as for ``celery -A``, e.g. ``tasks`` or ``tasks:app``)."""

import argparse
import json
import sys


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m rebound_celery")
    sub = ap.add_subparsers(dest="cmd", required=True)
    rp = sub.add_parser("replay", help="replay the dead letters waiting on a queue")
    rp.add_argument("app", help="the Celery app, as for celery -A (module or module:attribute)")
    rp.add_argument("queue", help="the dead-letter queue (the policy's deadLetterQueue)")
    rp.add_argument("--key", help="only this job (its rebound key)")
    rp.add_argument("--limit", type=int)
    args = ap.parse_args(argv)
    from celery.app.utils import find_app

    sys.path.insert(0, "")
    app = find_app(args.app)
    from .task import replay_dead_letters

    keys = replay_dead_letters(app, args.queue, key=args.key, limit=args.limit)
    print(json.dumps({"replayed": keys}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
