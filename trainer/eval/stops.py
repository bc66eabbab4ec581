"""Where generation stops: the end of the assistant's turn, as serving stops it.

Stopping only at the tokenizer's eos lets a chat target run past `<|im_end|>` into invented
`<|im_start|>user` turns that no drafter was trained on (assistant-only loss), and tau then falls with
--max-new-tokens for a reason that has nothing to do with the drafter. Serving stacks (vLLM, HF generate)
stop at the union of:
    * the tokenizer's eos token,
    * the model's generation_config.eos_token_id (an int or a list: Llama 3 lists <|eot_id|> there),
    * the chat template's end-of-turn token: the first special token the template writes after an
      assistant message's content (<|im_end|> in ChatML, <|eot_id|>, <end_of_turn>, ...).
"""

from __future__ import annotations

from typing import Any

_SENTINEL = "xq7 sentinel reply zq9"


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def chat_turn_end_token_id(tokenizer: Any) -> int | None:
    """The first special token the chat template writes after an assistant message; None without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template that rejects this minimal chat has no end token we can find
        return None
    if not isinstance(text, str) or _SENTINEL not in text:
        return None
    after = text[text.index(_SENTINEL) + len(_SENTINEL):]
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {int(i) for i, token in decoder.items() if getattr(token, "special", False)}
    for token_id in tokenizer(after, add_special_tokens=False)["input_ids"]:
        if token_id in special:
            return int(token_id)
    return None


def stop_token_ids(tokenizer: Any, model: Any = None) -> list[int]:
    """The ids that end a generated answer, sorted: eos, generation_config eos ids, the turn-end token."""
    stops: set[int] = set(_as_ids(getattr(tokenizer, "eos_token_id", None)))
    generation_config = getattr(model, "generation_config", None)
    stops |= set(_as_ids(getattr(generation_config, "eos_token_id", None)))
    turn_end = chat_turn_end_token_id(tokenizer)
    if turn_end is not None:
        stops.add(turn_end)
    return sorted(stops)
