"""A vLLM ``custom_class`` proposer that always drafts token 2 (tests: vLLM's own verification)."""


class ConstantProposer:
    def __init__(self, vllm_config):
        pass

    def load_model(self, target=None) -> None:
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, **_) -> list:
        return [[2] if s else [] for s in sampled_token_ids]
