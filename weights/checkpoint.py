"""The converted checkpoint format, its reader and writer, and conversion to and from Hugging Face Llama checkpoints.

Converted format (`twinflash-llama/1`), one directory:
  config.json                 {"format", "model": LlamaConfig fields, "dtype", "hf": what export needs to
                               rebuild the HF weight files: safetensors metadata, shard map}
  model.safetensors           or model-0000i-of-0000n.safetensors + model.safetensors.index.json
  hf_extra/                   the HF directory's non-weight files (config.json, tokenizer, generation config),
                              kept verbatim so that export reproduces them byte for byte

Tensor names and layouts (the module names of both backends' models are these names):
  tok_embeddings.weight                [vocab, hidden]
  layers.{i}.attention_norm.weight     [hidden]
  layers.{i}.attention.wq.weight       [heads * head_dim, hidden]      (out, in), as torch.nn.Linear
  layers.{i}.attention.wk.weight       [kv_heads * head_dim, hidden]
  layers.{i}.attention.wv.weight       [kv_heads * head_dim, hidden]
  layers.{i}.attention.wo.weight       [hidden, heads * head_dim]
  layers.{i}.ffn_norm.weight           [hidden]
  layers.{i}.feed_forward.w1.weight    [intermediate, hidden]          gate projection
  layers.{i}.feed_forward.w3.weight    [intermediate, hidden]          up projection
  layers.{i}.feed_forward.w2.weight    [hidden, intermediate]          down projection
  norm.weight                          [hidden]
  output.weight                        [vocab, hidden]                 absent when embeddings are tied

Rotary layout: HF's q/k projection rows are kept as HF stores them, i.e. already permuted from Meta's
interleaved pairs into the "rotate-half" order (pair i = features i and i + head_dim/2 of each head). Both
backends implement rotate-half RoPE, so nothing is permuted in either direction: conversion is a renaming,
which is what makes HF -> converted -> HF bit-identical, and the tests' negative control (a deliberately
interleaved rotary layout) shows the choice matters. Tensors keep the checkpoint's dtype.

Readers yield one tensor, or one slice of one, at a time (safetensors `get_slice`), so a process holding a
shard of a parameter never materialises the whole model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  registers bfloat16 with numpy so safetensors can hand bf16 tensors to numpy
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from weights.atomic import check_output_dir, publish_mode
from weights.config import PRESETS, LlamaConfig, parameter_shapes, preset, read_json
from weights.errors import CheckpointError

FORMAT = "twinflash-llama/1"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HF_EXTRA_DIR = "hf_extra"  # the HF directory's non-weight files, kept verbatim
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SHARD_BYTES = 2 << 30  # converted shards stay under 2 GiB so a writer holds at most that much at once

FLOAT_DTYPES = {"F32": np.dtype("float32"), "F16": np.dtype("float16"), "BF16": np.dtype(ml_dtypes.bfloat16)}
DTYPE_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}

# (HF name pattern, canonical name pattern); `{i}` is the layer index.
_HF_NAMES = (
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attention.wq.weight"),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.attention.wk.weight"),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.attention.wv.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.attention.wo.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.feed_forward.w1.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.feed_forward.w3.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.feed_forward.w2.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
)


def canonical_to_hf(name: str) -> str:
    """The HF tensor name of a canonical one."""
    for hf_pattern, canonical_pattern in _HF_NAMES:
        match = re.fullmatch(re.escape(canonical_pattern).replace(r"\{i\}", r"(?P<i>\d+)"), name)
        if match:
            return hf_pattern.format(i=match.groupdict().get("i"))
    raise AssertionError(f"no HF name for {name}")


# --- reading ----------------------------------------------------------------------------------------------


class SafetensorsFiles:
    """The tensors of one safetensors checkpoint, single-file or sharded with an index, opened lazily."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._handles: dict[str, Any] = {}
        if (self.directory / INDEX_FILE).is_file():
            index = read_json(self.directory / INDEX_FILE)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"corrupt {self.directory / INDEX_FILE}: no weight_map")
            self.weight_map: dict[str, str] = weight_map
        elif (self.directory / SINGLE_FILE).is_file():
            self.weight_map = {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}
        else:
            pickles = sorted(p.name for p in self.directory.glob("*") if p.suffix in PICKLE_SUFFIXES)
            if pickles:
                raise CheckpointError(
                    f"{self.directory / pickles[0]} is a pickle checkpoint, which twinflash refuses to load; "
                    "convert it to safetensors first (transformers: model.save_pretrained(dir))")
            raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.directory}")

    def _open(self, filename: str) -> Any:
        if filename not in self._handles:
            path = self.directory / filename
            if not path.is_file():
                raise CheckpointError(f"missing checkpoint file {path}")
            try:
                self._handles[filename] = safe_open(str(path), framework="numpy")
            except (SafetensorError, OSError) as bad:
                raise CheckpointError(f"corrupt safetensors file {path}: {bad}") from None
        return self._handles[filename]

    def names(self) -> list[str]:
        return list(self.weight_map)

    def metadata(self) -> dict[str, str] | None:
        return self._open(next(iter(self.weight_map.values()))).metadata() if self.weight_map else None

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype string such as 'BF16') without reading the data."""
        view = self._open(self.weight_map[name]).get_slice(name)
        return tuple(view.get_shape()), view.get_dtype()

    def tensor(self, name: str) -> np.ndarray:
        try:
            return self._open(self.weight_map[name]).get_tensor(name)
        except SafetensorError as bad:
            raise CheckpointError(f"corrupt tensor {name} in {self.directory}: {bad}") from None

    def tensor_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        try:
            return self._open(self.weight_map[name]).get_slice(name)[index]
        except SafetensorError as bad:
            raise CheckpointError(f"corrupt tensor {name} in {self.directory}: {bad}") from None


class ConvertedCheckpoint:
    """Reader of a converted directory: `config`, `dtype`, and tensors by canonical name, whole or sliced."""

    def __init__(self, directory: Path | str):
        directory = Path(directory)
        if not directory.is_dir():
            raise CheckpointError(f"missing checkpoint directory {directory}")
        meta = read_json(directory / "config.json")
        if meta.get("format") != FORMAT:
            hint = " (a Hugging Face checkpoint? run `twinflash convert` first)" if _is_hf_config(meta) else ""
            raise CheckpointError(f"{directory / 'config.json'} is not a {FORMAT} checkpoint{hint}")
        self.directory = directory
        self.meta = meta
        self.config = LlamaConfig.from_dict(meta["model"])
        self.dtype = str(meta["dtype"])
        self.files = SafetensorsFiles(directory)
        _validate(self.config, {n: self.files.info(n) for n in self.files.names()},
                  expected_dtype=self.dtype, where=str(directory), rename=lambda n: n)

    def names(self) -> list[str]:
        return list(parameter_shapes(self.config))

    def tensor(self, name: str) -> np.ndarray:
        return self.files.tensor(name)

    def tensor_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self.files.tensor_slice(name, index)

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self.names():
            yield name, self.tensor(name)


class RandomWeights:
    """A preset's deterministic random weights, the same numbers for both backends.

    Norm weights are ones; matrices are N(0, 0.02), as HF's `initializer_range`. Every block of
    `ROWS_PER_STREAM` rows (dim 0, the dim the sharding table splits) draws from its own numpy stream seeded by
    (seed, crc32 of the tensor's name, block index): a process holding rows [a, b) of a parameter makes only the
    blocks covering them, the same numbers as the whole tensor, and the blocks are drawn on all host cores (numpy's
    generators release the GIL). An 8B preset is 8e9 draws; one stream per tensor took about a minute in every process.
    """

    dtype = "float32"
    ROWS_PER_STREAM = 256

    def __init__(self, config: LlamaConfig, seed: int = 0):
        self.config = config
        self.seed = seed
        self._shapes = parameter_shapes(config)

    def names(self) -> list[str]:
        return list(self._shapes)

    def tensor(self, name: str) -> np.ndarray:
        return self._rows(name, 0, self._shapes[name][0])

    def tensor_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        start, stop, step = index[0].indices(self._shapes[name][0])
        if step != 1:
            return self.tensor(name)[index]
        return self._rows(name, start, stop)[(slice(None),) + tuple(index[1:])]

    def _rows(self, name: str, start: int, stop: int) -> np.ndarray:
        shape = self._shapes[name]
        if len(shape) == 1:
            return np.ones(max(stop - start, 0), dtype=np.float32)
        rows = self.ROWS_PER_STREAM
        out = np.empty((max(stop - start, 0),) + shape[1:], dtype=np.float32)
        name_key = zlib.crc32(name.encode())

        def fill(block: int) -> None:
            low, high = max(block * rows, start), min((block + 1) * rows, stop)
            values = np.random.default_rng([self.seed, name_key, block]).standard_normal(
                (min((block + 1) * rows, shape[0]) - block * rows,) + shape[1:], dtype=np.float32)
            out[low - start:high - start] = values[low - block * rows:high - block * rows] * np.float32(0.02)

        blocks = range(start // rows, -(-stop // rows)) if stop > start else range(0)
        with ThreadPoolExecutor(max_workers=min(len(blocks), os.cpu_count() or 1) or 1) as pool:
            list(pool.map(fill, blocks))
        return out

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self.names():
            yield name, self.tensor(name)


def open_weights(model: str | Path, seed: int = 0) -> ConvertedCheckpoint | RandomWeights:
    """A converted checkpoint directory, or a preset name (random weights from `seed`)."""
    path = Path(model)
    if path.is_dir():
        return ConvertedCheckpoint(path)
    if str(model) in PRESETS:  # before the path test: preset names have dots ("llama3.2-1b")
        return RandomWeights(PRESETS[str(model)], seed)
    if os.sep in str(model) or path.suffix or path.exists():
        raise CheckpointError(f"missing checkpoint directory {model}")
    return RandomWeights(preset(str(model)), seed)


def _validate(config: LlamaConfig, found: dict[str, tuple[tuple[int, ...], str]], expected_dtype: str | None,
              where: str, rename) -> None:
    """Every expected tensor present with its shape and dtype, nothing unexpected. `rename` maps canonical
    names to the names in `found`."""
    shapes = parameter_shapes(config)
    expected = {rename(n): shape for n, shape in shapes.items()}
    for name in found:
        if name not in expected:
            raise CheckpointError(f"{where}: unexpected tensor {name} (not part of a Llama model of this config)")
    for name, shape in expected.items():
        if name not in found:
            raise CheckpointError(f"{where}: missing tensor {name}")
        actual, dtype = found[name]
        if actual != shape:
            raise CheckpointError(f"{where}: tensor {name} has shape {list(actual)}, "
                                  f"config expects {list(shape)}")
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{where}: tensor {name} has dtype {dtype}; expected F32, F16 or BF16")
        if expected_dtype is not None and dtype != DTYPE_NAMES.get(expected_dtype, expected_dtype):
            raise CheckpointError(f"{where}: tensor {name} has dtype {dtype}, config says {expected_dtype}")


# --- conversion ---------------------------------------------------------------------------------------


def _fresh_output(out_dir: Path) -> Path:
    """A temporary sibling of `out_dir` to write into; refuses to touch an existing non-empty `out_dir`, or one
    that cannot be written."""
    check_output_dir(out_dir, "output directory", empty=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))


def _publish(tmp: Path, out_dir: Path) -> None:
    publish_mode(tmp, directory=True)  # mkdtemp's 0700 would make the published directory private
    if out_dir.exists():
        out_dir.rmdir()
    os.replace(tmp, out_dir)


def _write_tensors(out: Path, names: list[str], read, weight_map: dict[str, str] | None,
                   metadata: dict[str, str] | None) -> None:
    """Writes `read(name)` for each name, into the files `weight_map` assigns (or sized shards when None)."""
    if weight_map is None:
        weight_map, size, shard = {}, 0, 0
        for name in names:
            nbytes = read(name).nbytes
            if size and size + nbytes > SHARD_BYTES:
                shard, size = shard + 1, 0
            weight_map[name] = str(shard)
            size += nbytes
        count = shard + 1
        weight_map = {n: SINGLE_FILE if count == 1 else f"model-{int(s) + 1:05d}-of-{count:05d}.safetensors"
                      for n, s in weight_map.items()}
    files: dict[str, list[str]] = {}
    for name in names:
        files.setdefault(weight_map[name], []).append(name)
    for filename, members in files.items():
        save_file({n: np.ascontiguousarray(read(n)) for n in members}, str(out / filename), metadata=metadata)
        publish_mode(out / filename)  # safetensors writes 0600 whatever the umask
    if set(files) != {SINGLE_FILE}:
        total = sum(read(n).nbytes for n in names)
        index = {"metadata": {"total_size": total}, "weight_map": {n: weight_map[n] for n in names}}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")  # as transformers


def _hf_extra_files(directory: Path) -> list[Path]:
    """The HF directory's files other than weights (config.json and the shard index among them), kept verbatim
    for export."""
    return [p for p in sorted(directory.iterdir())
            if p.is_file() and p.suffix != ".safetensors" and p.suffix not in PICKLE_SUFFIXES]


def _write_converted(out_dir: Path, config: LlamaConfig, dtype: str, read, hf: dict[str, Any],
                     hf_extra: Sequence[Path]) -> None:
    """Writes a converted directory: `read(name)` for every tensor of `config`'s model (in sized shards),
    `hf_extra` files under hf_extra/, config.json (with `hf`, what export needs) last; all into a temporary
    sibling of `out_dir`, read back, then renamed into place."""
    tmp = _fresh_output(out_dir)
    try:
        meta = {"format": FORMAT, "model": config.to_dict(), "dtype": dtype, "hf": hf}
        _write_tensors(tmp, list(parameter_shapes(config)), read, None, hf["safetensors_metadata"])
        if hf_extra:
            (tmp / HF_EXTRA_DIR).mkdir()
            for path in hf_extra:
                shutil.copy2(path, tmp / HF_EXTRA_DIR / path.name)
        (tmp / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
        ConvertedCheckpoint(tmp)  # read back what was written before publishing it
        _publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_converted_checkpoint(tensors: Mapping[str, np.ndarray], config: LlamaConfig, out_dir: Path | str,
                               hf_extra: Sequence[Path] = ()) -> None:
    """float32 tensors by canonical name, exactly the parameters of `config`'s model (trained weights, say) -> a
    converted directory `out_dir`, written atomically; `hf_extra` files (tokenizer etc.) are kept for export."""
    expected = parameter_shapes(config)
    if set(tensors) != set(expected):
        raise ValueError(f"tensors must be exactly the model's parameters; got {sorted(set(tensors) ^ set(expected))}"
                         " extra or missing")
    hf = {"safetensors_metadata": {"format": "pt"}, "weight_map": None, "tied_head_stored": False}
    _write_converted(Path(out_dir), config, "float32", tensors.__getitem__, hf, hf_extra)


def kept_hf_files(source: ConvertedCheckpoint | RandomWeights) -> list[Path]:
    """The Hugging Face files a converted `source` kept that describe the model rather than its weight files
    (tokenizer, generation config): what a checkpoint of other weights of the same model carries on. Not its
    config.json (it may declare another dtype) nor its shard index; none for random weights."""
    extra = source.directory / HF_EXTRA_DIR if isinstance(source, ConvertedCheckpoint) else None
    if extra is None or not extra.is_dir():
        return []
    return [p for p in sorted(extra.iterdir()) if p.name not in ("config.json", INDEX_FILE)]


def _is_hf_config(meta: dict) -> bool:
    return "model_type" in meta and meta.get("format") != FORMAT


def is_hf_checkpoint(path: Path | str) -> bool:
    """Whether `path` is a Hugging Face checkpoint directory (a config.json naming a `model_type`), which
    `convert_hf_checkpoint` reads, rather than a converted one or a preset's name."""
    config = Path(path) / "config.json"
    return config.is_file() and _is_hf_config(read_json(config))


def model_config(model: str | Path) -> LlamaConfig:
    """The config of a converted directory, a Hugging Face directory (before converting it) or a preset."""
    if is_hf_checkpoint(model):
        return LlamaConfig.from_hf_dict(read_json(Path(model) / "config.json"))
    return open_weights(model).config


def convert_hf_checkpoint(hf_dir: Path | str, out_dir: Path | str) -> LlamaConfig:
    """HF Llama safetensors checkpoint -> converted directory. Validates before writing anything."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"missing checkpoint directory {hf_dir}")
    hf_config = read_json(hf_dir / "config.json")
    config = LlamaConfig.from_hf_dict(hf_config)
    files = SafetensorsFiles(hf_dir)
    found = {name: files.info(name) for name in files.names()}
    tied_head = config.tie_word_embeddings and "lm_head.weight" in found
    if tied_head:  # some exports store the tied head too; it must be the embedding itself
        if not np.array_equal(files.tensor("lm_head.weight"), files.tensor("model.embed_tokens.weight")):
            raise CheckpointError(f"{hf_dir}: lm_head.weight differs from model.embed_tokens.weight "
                                  "but config.json says tie_word_embeddings=true")
        del found["lm_head.weight"]
    dtypes = {dtype for _, dtype in found.values()}
    declared = hf_config.get("dtype") or hf_config.get("torch_dtype")
    dtype = next(iter(dtypes)) if len(dtypes) == 1 else None
    _validate(config, found, expected_dtype=declared if declared in DTYPE_NAMES else dtype,
              where=str(hf_dir), rename=canonical_to_hf)
    if dtype is None:
        raise CheckpointError(f"{hf_dir}: tensors mix dtypes {sorted(dtypes)}; expected one")
    dtype_name = {v: k for k, v in DTYPE_NAMES.items()}[dtype]

    has_index = (hf_dir / INDEX_FILE).is_file()
    hf = {"safetensors_metadata": files.metadata(), "weight_map": files.weight_map if has_index else None,
          "tied_head_stored": tied_head}
    _write_converted(out_dir, config, dtype_name, lambda n: files.tensor(canonical_to_hf(n)), hf,
                     _hf_extra_files(hf_dir))
    return config


def export_hf_checkpoint(converted_dir: Path | str, hf_dir: Path | str) -> LlamaConfig:
    """Converted directory -> HF Llama checkpoint, file for file as the original when it came from HF."""
    source = ConvertedCheckpoint(converted_dir)
    hf_dir = Path(hf_dir)
    hf_meta = source.meta.get("hf") or {}
    tmp = _fresh_output(hf_dir)
    try:
        names = source.names()
        hf_names = [canonical_to_hf(n) for n in names]
        reads = dict(zip(hf_names, names))
        if hf_meta.get("tied_head_stored"):
            hf_names.append("lm_head.weight")
            reads["lm_head.weight"] = "tok_embeddings.weight"
        metadata = hf_meta.get("safetensors_metadata") or {"format": "pt"}
        weight_map = hf_meta.get("weight_map")
        if weight_map is not None and set(weight_map) != set(hf_names):
            weight_map = None
        _write_tensors(tmp, sorted(hf_names), lambda n: source.tensor(reads[n]), weight_map, metadata)
        hf_config = source.config.to_hf_dict(source.dtype)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        extra = source.directory / HF_EXTRA_DIR  # the original config.json among them, replacing the generated one
        if extra.is_dir():
            for path in extra.iterdir():
                if path.name != INDEX_FILE or weight_map is not None:  # the original index fits the original shards
                    shutil.copy2(path, tmp / path.name)
        _publish(tmp, hf_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return source.config
