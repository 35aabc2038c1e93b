# GPU debug: what the JAX trace's device events carry, and whether their HLO ops are found (tiny model)
import glob, json, os, sys, tempfile, collections
import jax
from compare.train import TrainSettings, training_batches
from weights.parallel import MeshShape
from jax_impl.train import build_training, train_step, step_scalars
from jax_impl.parallel import sharded_batch
from jax_impl.profiling import _Hlo, _hlo_op
from weights.training import adamw_coefficients
s = TrainSettings(backend="jax", model="tiny", seq_len=256, steps=3, mesh=MeshShape(fsdp=1), batch=1, attention_backend="cudnn", dtype="bf16")
run = build_training(s); b = training_batches(s, run.spec.config); state = run.state
def step(i, state):
    t, tg, p = sharded_batch(b[i], run.mesh); c = step_scalars(adamw_coefficients(s.optimizer, i))
    state, loss, gn = train_step(state, t, tg, p, c, spec=run.spec); float(loss); return state, (t, tg, p, c)
state, args = step(0, state)
d = tempfile.mkdtemp(); jax.profiler.start_trace(d); state, args = step(1, state); jax.profiler.stop_trace()
hlo = _Hlo(train_step.lower(state, *args, spec=run.spec).compile().as_text())
(x,) = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
out = {"instructions": len(hlo.instructions), "frames": len(hlo.frames), "planes": {}}
for plane in jax.profiler.ProfileData.from_file(x).planes:
    lines = {}
    for line in plane.lines:
        evs = list(line.events)
        ops = [_hlo_op(e) for e in evs]
        lines[line.name] = {"events": len(evs), "with_op": sum(bool(o) for o in ops),
                            "found": sum(o in hlo.instructions for o in ops),
                            "sample": [{"name": e.name[:80], "stats": {k: str(v)[:200] for k, v in e.stats}} for e in evs[:3]]}
    out["planes"][plane.name] = lines
json.dump(out, open(os.path.join(os.environ["OUT"], "debug-jax-trace.json"), "w"), indent=1)
for p, ls in out["planes"].items():
    print(p, {n: (l["events"], l["with_op"], l["found"]) for n, l in ls.items()})
