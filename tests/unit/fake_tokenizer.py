"""A tokenizer of one token per character: enough for the rollout engine to run without a model (shared by the
reliability tests of environments, their deadlines and the vLLM backend's context budget)."""


class FakeTokenizer:
    eos_token_id, pad_token_id, bos_token, eos_token = 0, 0, None, None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)
