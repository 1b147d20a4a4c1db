"""Entry point of one verifier worker process; started by ``VerifierPool``, not by hand."""
import argparse
from multiprocessing.connection import Connection

from megatron_rl.rewards.pool import _worker_main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="socket to the parent")
    parser.add_argument("--soft-timeout", type=float, required=True)
    parser.add_argument("--memory-limit-mb", type=int, default=0)
    parser.add_argument("--warmup", default="", help="module:function to call before reporting ready")
    args = parser.parse_args()
    warmup = tuple(args.warmup.split(":", 1)) if args.warmup else None
    _worker_main(Connection(args.fd), args.soft_timeout, args.memory_limit_mb or None, warmup)


if __name__ == "__main__":
    main()
