"""What ``LLM.generate`` returns for each prompt."""

from __future__ import annotations

import attrs


@attrs.frozen
class RequestOutput:
    """One prompt's result.

    - ``prompt_token_ids``: the prompt as token ids (encoded when it was given as text).
    - ``token_ids``: the generated ids, including the stop token that ended it, if any.
    - ``text``: ``token_ids`` decoded (special tokens skipped); None without a tokenizer.
    - ``finish_reason``: ``"stop"`` (EOS or a ``stop_token_ids`` entry) or ``"length"``
      (``max_tokens`` or ``max_model_len`` reached).
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str

    def as_dict(self) -> dict:
        return {
            "prompt_token_ids": list(self.prompt_token_ids),
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finish_reason": self.finish_reason,
        }
