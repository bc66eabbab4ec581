"""Write the embedded corpus's held-out ChatML conversations as chat rows (`{"messages": [...]}`), so
`trainer eval RUN --data FILE` measures tau on chat prompts with the embedded target (BENCHMARKS.md,
"Eval on chat data"). Fewer than 20 rows: the trainer uses the whole file as held-out prompts.

    python bench/chat_eval_data.py OUT.jsonl [--max-rows 19]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from trainer.data.corpus import embedded_documents

TURN = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)<\|im_end\|>\n", re.S)


def chats(split: str = "heldout") -> list[list[dict[str, str]]]:
    rows = []
    for document in embedded_documents(split):
        turns = TURN.findall(document)
        if turns and "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns) == document:
            rows.append([{"role": role, "content": content} for role, content in turns])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-rows", type=int, default=19)
    args = parser.parse_args()
    rows = chats()[: args.max_rows]
    args.out.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    print(f"{len(rows)} conversations -> {args.out}")


if __name__ == "__main__":
    main()
