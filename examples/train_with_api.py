"""Train the built-in model with a loop of your own, through the Python API.

    python3 examples/train_with_api.py --dp 1                           # one process
    torchrun --nproc-per-node 2 examples/train_with_api.py              # data parallel over two ranks
    torchrun --nproc-per-node 4 examples/train_with_api.py --dp 2 --tp 2 --sp --steps 50

Any flag of ``parallelisms train`` can be given (``--zero 3``, ``--pp 2 --schedule zb-v``, ...): they are
checked as the command line checks them, against torchrun's world size too. The loop below is all there is
to it: build the full seeded model, apply the layout, feed each rank its rows of the global batch.
"""

import sys

import torch.distributed as dist

import parallelisms


def main(argv: list[str]) -> None:
    cfg = parallelisms.configure(argv, steps=20)  # the flags in argv come last and win
    model = parallelisms.build_model(cfg.model, seed=cfg.train.seed)
    trainer = parallelisms.parallelize(model, cfg.layout, cfg.train)
    rank = dist.get_rank() if dist.is_initialized() else 0
    for step, (inputs, targets) in enumerate(parallelisms.batches(cfg.train, cfg.layout)):
        loss = trainer.train_step(inputs, targets)  # forward, backward, gradient sync, clip, AdamW
        if rank == 0 and (step % 5 == 0 or step == cfg.train.steps - 1):
            print(f"{cfg.layout.label()} step {step:3d}: loss {loss.item():.4f} (rank 0's rows)", flush=True)
    trainer.close()  # every rank: hooks out, one barrier, the shared-memory transports stopped, the groups freed
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
