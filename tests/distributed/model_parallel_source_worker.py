"""Worker for test_run_on_rank.py's model-parallel test (two ranks under torchrun, gloo, TP2:
one model-parallel group): parallel.model_parallel_source runs a rank-dependent function on the
group's first rank alone and hands its result to both. Prints `RESULT {json}` per rank."""
import json

import torch.distributed as dist

from megatron_rl.parallel import ParallelConfig, init_distributed, model_parallel_source


def main() -> None:
    init_distributed(ParallelConfig(tensor_model_parallel_size=2))
    rank, ran = dist.get_rank(), []

    def answer():  # what a tool would answer on this rank, e.g. one timed out and one not
        ran.append(rank)
        return {"answered_by": rank, "text": f"tool output on rank {rank}"}

    got = model_parallel_source(answer)
    print("RESULT " + json.dumps({"rank": rank, "got": got, "ran": ran}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from megatron_rl.processes import skip_exit_collection

    skip_exit_collection()  # the heap is the imports': no shutdown collection over it
