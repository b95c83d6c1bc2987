"""Train a small HF Llama with the HF Trainer and fxpar (uneven plans, online re-balancing).

    torchrun --nproc-per-node 2 examples/train_trainer.py --fxpar-config examples/fxpar.yaml
    FXPAR_CONFIG=examples/fxpar.yaml torchrun --nproc-per-node 2 examples/train_trainer.py --steps 8

On CPU the ranks use gloo and emulate the relative speeds the config names (labelled emulated);
a cluster of GPUs runs on NCCL, one process per GPU.
``--slow-down RANK:SPEED:STEP`` changes a rank's emulated speed at a step (to watch the callback
re-balance); ``--out FILE`` writes the loss curve, step times and re-balance events as JSON.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainingArguments, default_data_collator

from fxpar.integrations import load_config, parallelize
from fxpar.integrations.trainer import FxparCallback, FxparTrainer
from fxpar.models import PRESETS
from fxpar.runtime import init_distributed
from fxpar.synthetic import TokenDataset
from fxpar.tracing.hf import build_model


class SlowDown(TrainerCallback):
    """Changes one rank's emulated speed at a given step (a device that slows down mid-run)."""

    def __init__(self, pmodel, rank: int, speed: float, step: int) -> None:
        self.pmodel, self.rank, self.speed, self.step = pmodel, rank, speed, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and dist.get_rank() == self.rank:
            self.pmodel.emulator.speed = self.speed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fxpar-config", default=os.environ.get("FXPAR_CONFIG"))
    ap.add_argument("--model", default="llama-tiny", choices=sorted(PRESETS))
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--output-dir", default="trainer-out")
    ap.add_argument("--slow-down", help="RANK:SPEED:STEP")
    ap.add_argument("--no-shuffle", action="store_true")
    ap.add_argument("--eval", action="store_true", help="evaluate on held-out data after training")
    ap.add_argument("--save-steps", type=int, default=0, help="write checkpoint-N every N steps")
    ap.add_argument("--resume", help="resume from this checkpoint-N folder (or 'last')")
    ap.add_argument("--out", help="write losses / step times / events JSON here (rank 0)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    config = load_config(args.fxpar_config)
    # gloo (GPUs hidden) for emulated CPU ranks, NCCL for a cluster of GPUs; it prints which
    init_distributed(cluster=None if config.cluster == "detect" else config.resolve_cluster())
    on_cpu = dist.get_backend() == "gloo"
    batch = int(config.options.global_batch or 8)
    model = build_model(PRESETS[args.model], device="cpu", seed=0).train()
    data = TokenDataset(batch * args.steps, args.seq, model.config.vocab_size)
    example = default_data_collator([data[i] for i in range(batch)])
    pmodel = parallelize(model, config, example)
    if dist.get_rank() == 0:
        print(pmodel.plan, flush=True)

    callback = FxparCallback(config.rebalance, log_every=1)
    callbacks = [callback]
    if args.slow_down:
        r, s, k = args.slow_down.split(":")
        callbacks.append(SlowDown(pmodel, int(r), float(s), int(k)))
    targs = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, learning_rate=args.lr,
                              lr_scheduler_type="constant", logging_steps=1,
                              save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
                              report_to=[], use_cpu=on_cpu, seed=0, disable_tqdm=True,
                              per_device_train_batch_size=batch, per_device_eval_batch_size=4)
    trainer = FxparTrainer(model=pmodel, args=targs, train_dataset=data,
                           data_collator=default_data_collator, callbacks=callbacks,
                           shuffle=not args.no_shuffle)
    trainer.train(resume_from_checkpoint=(True if args.resume == "last" else args.resume))
    metrics = trainer.evaluate(TokenDataset(24, args.seq, model.config.vocab_size, seed=1)) if args.eval else {}
    trainer.save_model(args.output_dir)
    if dist.get_rank() == 0 and args.out:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        logged_steps = [h["step"] for h in trainer.state.log_history if "loss" in h]
        steps = [h["fxpar/step_s"] for h in trainer.state.log_history if "fxpar/step_s" in h]
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "logged_steps": logged_steps, "step_s": steps, "events": callback.events,
                       "eval_loss": metrics.get("eval_loss"),
                       "plan": json.loads(pmodel.plan.to_json())}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
