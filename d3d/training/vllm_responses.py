"""``d3d data --engine vllm``: the target's greedy responses decoded by vLLM.

A :class:`~d3d.training.responses.Responder` over vLLM's offline engine (``vllm.LLM``): the
prompts go in as token ids (the records' own ``prompt_ids``), greedy, ending on the target's end
ids like the own engine, and the response ids come back as vLLM made them (the end id
included, as the own engine's records have it). No drafter: vLLM alone, with its continuous
batching of up to ``batch_size`` sequences and, on a GPU, its compiled kernels and graphs.

Records are written as each chunk of prompts (a few batches) finishes, so a killed run keeps what
it had and a rerun resumes (:func:`d3d.training.responses.generate_data` skips written ids);
vLLM's engine starts with the first prompt left to answer, so a rerun with none starts nothing.
The process holds the target once, in vLLM; this side reads only the tokenizer and the end ids
(:func:`d3d.model.load.load_text`). On a CPU vLLM's engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, unless set): its own two processes would each import vLLM
in turn before the first token (about 20 s of a 23 s start here, against 4 s in one) and then
share the cores with this one; on a GPU it keeps its own process. Soft labels (``--keep-topk``)
need the target's full distribution at every response position, which this path does not
compute: they are refused here with a message (the own engine writes them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import replace

from d3d.config import ModelConfig
from d3d.model.load import load_text
from d3d.training.responses import Response
from d3d.vllm.engine import engine_args, on_vllm_cores, prepare_env

log = logging.getLogger(__name__)

IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"  # vLLM's switch: "0" runs its engine core here
CHUNK_BATCHES = 4  # prompts handed to vLLM at once, in batches: records are written per chunk


class VllmResponder:
    """Greedy responses from vLLM (see the module docstring)."""

    def __init__(
        self, cfg: ModelConfig, batch_size: int, max_model_len: int | None = None, eager=False
    ):
        self.cfg = replace(cfg, drafter="none")  # vLLM alone: data is the target's own text
        self.text = load_text(self.cfg.target)
        self.args = engine_args(
            self.cfg, max_batch=batch_size, eager=eager, max_model_len=max_model_len or None
        )
        self.args.pop("served_model_name", None)
        self.args["skip_tokenizer_init"] = True  # ids in, ids out: the tokenizer lives here
        self.llm = None

    def start(self) -> None:
        """Start vLLM's engine (once; the first prompt to answer starts it, so a rerun with
        nothing left to write never does)."""
        if self.llm is not None:
            return
        from vllm import LLM

        prepare_env(self.cfg)
        log.info("vLLM engine arguments for data: %s", self.args)
        # read as the engine starts (module docstring); a value the user set is theirs
        here = not self.cfg.target_device.startswith("cuda") and IN_PROCESS not in os.environ
        if here:
            os.environ[IN_PROCESS] = "0"
        try:
            with on_vllm_cores(self.cfg):
                self.llm = LLM(**self.args)
        finally:
            if here:
                del os.environ[IN_PROCESS]

    @property
    def tokenizer(self):
        return self.text.tokenizer

    def respond(
        self, prompts: Sequence[list[int]], max_new_tokens: int, batch_size: int
    ) -> Iterator[Response]:
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_new_tokens,
            stop_token_ids=sorted(self.text.eos_token_ids),
            detokenize=False,
        )
        if prompts:
            self.start()
        chunk = max(1, batch_size * CHUNK_BATCHES)
        for start in range(0, len(prompts), chunk):
            part = [{"prompt_token_ids": list(p)} for p in prompts[start : start + chunk]]
            outs = self.llm.generate(part, params, use_tqdm=False)
            for i, out in enumerate(outs):
                yield Response(start + i, list(out.outputs[0].token_ids))

    def top_k(self, prompt_ids: Sequence[int], response: Sequence[int], k: int) -> dict:
        raise ValueError(
            "--keep-topk: soft labels are written by the own engine; drop --engine vllm for them"
        )
