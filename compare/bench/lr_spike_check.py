"""CPU check of the default optimizer settings (weights/schedule.py, issue 22): a few-layer model of the
Llama-3.2-1B width trained on text with the old defaults (peak lr 3e-3, 5 warmup steps) and with today's, fp32, the
plain-math attention (the kernel plays no part in the learning rate). Prints both loss curves and each one's spike
(the largest loss after step 0 over the loss at step 0: above 1, the run got worse than where it started) and
writes them as JSON.

    python -m compare.bench.lr_spike_check --out DIR [--layers 2] [--vocab 256] [--seq-len 512] [--steps 20]

About 15 s per step per layer at the defaults on 2 busy CPU cores (two runs of 20 steps, 2 layers: ~20 min).
The vocabulary is cut to the 256 byte tokens the text data uses (the 1B shape's 128256 rows would add 262M
parameters to every AdamW step and nothing to the question); the width, heads and MLP are the 1B shape's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from weights import PRESETS, parameter_shapes, write_converted_checkpoint
from weights.checkpoint import RandomWeights
from weights.schedule import default_optimizer

OLD_DEFAULTS = {"lr": 3e-3, "warmup_steps": 5}  # every model's defaults before issue 22


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    config = dataclasses.replace(PRESETS["llama3.2-1b"], num_layers=args.layers, vocab_size=args.vocab)
    model = args.out / "model"
    weights = RandomWeights(config, 0)
    write_converted_checkpoint({name: weights.tensor(name) for name in parameter_shapes(config)}, config, model)
    new = default_optimizer(config.hidden_size, args.steps)
    runs = {"old": OLD_DEFAULTS, "new": {"lr": new.lr, "warmup_steps": new.warmup_steps}}
    result = {"config": config.to_dict(), "seq_len": args.seq_len, "steps": args.steps, "runs": {}}
    for name, optimizer in runs.items():
        out = args.out / name
        subprocess.run([sys.executable, "-m", "compare.cli", "train", "--model", str(model), "--seq-len",
                        str(args.seq_len), "--steps", str(args.steps), "--data", "text", "--attention-backend",
                        "reference", "--lr", str(optimizer["lr"]), "--warmup-steps", str(optimizer["warmup_steps"]),
                        "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
        losses = [json.loads(line)["loss"] for line in (out / "train.jsonl").read_text().splitlines()]
        result["runs"][name] = {**optimizer, "losses": losses, "spike": max(losses[1:]) / losses[0]}
    (args.out / "lr_spike_check.json").write_text(json.dumps(result, indent=1))
    for name, run in result["runs"].items():
        print(f"{name}: lr {run['lr']:g}, warmup {run['warmup_steps']}: spike {run['spike']:.2f}; losses "
              + " ".join(f"{v:.2f}" for v in run["losses"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
