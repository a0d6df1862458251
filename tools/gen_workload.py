"""Generate a seeded Mooncake-format workload (JSON Lines) for ``kvflow simulate`` and the tests.

The shape imitates what makes prefix caching pay off in chat serving: a handful of system prompts
shared by many conversations, and multi-turn conversations whose every turn resends the whole
history (previous prompt + previous answer) plus a new user message, so each turn's prompt extends
the previous one. Several conversations are open at once and their turns interleave; arrivals are
a Poisson process. Only the block structure is generated (no text): hash ids are handed out from a
counter, a prefix block keeps its id while its content is unchanged, and the partial last block of
a turn gets a fresh id in the next turn because the history grows into it.

The same ``--seed`` always gives the same file (``random.Random(seed)``, no other source of
randomness), so a generated workload can be reproduced from its command line.

Usage::

    python tools/gen_workload.py --requests 200 --seed 7 --block-tokens 512 --out kvflow/simulate/example.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

SYSTEM_PROMPTS = 4
"""Distinct system prompts shared by all conversations."""
OPEN_CONVERSATIONS = 10
"""Conversations in progress at once; a new one starts when fewer are open."""
NEW_CONVERSATION_PROBABILITY = 0.1
"""Chance that an arrival starts a new conversation even when enough are open."""
MEAN_INTERARRIVAL_MS = 400.0


@dataclass
class _Conversation:
    prompt_hash_ids: list[int]
    prompt_tokens: int
    answer_tokens: int


class _WorkloadGenerator:
    def __init__(self, seed: int, block_tokens: int, max_prompt_blocks: int) -> None:
        self.rng = random.Random(seed)
        self.block_tokens = block_tokens
        self.max_prompt_tokens = max_prompt_blocks * block_tokens
        self.next_hash_id = 0
        self.system_prompts: list[tuple[int, list[int]]] = []
        for _ in range(SYSTEM_PROMPTS):
            tokens = self.rng.randint(block_tokens // 2, 4 * block_tokens)
            self.system_prompts.append((tokens, self._fresh_ids(tokens // block_tokens)))
        self.open: list[_Conversation] = []

    def _fresh_ids(self, count: int) -> list[int]:
        ids = list(range(self.next_hash_id, self.next_hash_id + count))
        self.next_hash_id += count
        return ids

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def _user_message_tokens(self) -> int:
        return self.rng.randint(20, 3 * self.block_tokens)

    def _answer_tokens(self) -> int:
        return self.rng.randint(16, self.block_tokens)

    def _start_conversation(self) -> _Conversation:
        system_tokens, system_ids = self.rng.choice(self.system_prompts)
        tokens = system_tokens + self._user_message_tokens()
        # The system prompt's full blocks are shared; its partial block holds this
        # conversation's own text too, so it and everything after it is new.
        ids = system_ids + self._fresh_ids(self._blocks(tokens) - len(system_ids))
        return _Conversation(ids, tokens, self._answer_tokens())

    def _continue(self, conversation: _Conversation) -> _Conversation | None:
        """The next turn of ``conversation``, or None when it would outgrow the prompt limit."""
        tokens = conversation.prompt_tokens + conversation.answer_tokens
        tokens += self._user_message_tokens()
        if tokens > self.max_prompt_tokens:
            return None
        kept = conversation.prompt_hash_ids[: conversation.prompt_tokens // self.block_tokens]
        ids = kept + self._fresh_ids(self._blocks(tokens) - len(kept))
        return _Conversation(ids, tokens, self._answer_tokens())

    def next_request(self) -> _Conversation:
        while True:
            if len(self.open) < OPEN_CONVERSATIONS or (
                self.rng.random() < NEW_CONVERSATION_PROBABILITY
            ):
                turn = self._start_conversation()
                self.open.append(turn)
                return turn
            index = self.rng.randrange(len(self.open))
            turn = self._continue(self.open[index])
            if turn is None:
                del self.open[index]  # finished; the loop starts a new one in its place
                continue
            self.open[index] = turn
            return turn


def generate_workload(
    requests: int, seed: int, block_tokens: int = 512, max_prompt_blocks: int = 30
) -> list[dict[str, object]]:
    """Return ``requests`` Mooncake records (dicts in the file's key order)."""
    if requests < 1 or block_tokens < 1 or max_prompt_blocks < 5:
        raise ValueError("need requests >= 1, block_tokens >= 1 and max_prompt_blocks >= 5")
    generator = _WorkloadGenerator(seed, block_tokens, max_prompt_blocks)
    clock_ms = 0.0
    records: list[dict[str, object]] = []
    for _ in range(requests):
        turn = generator.next_request()
        records.append(
            {
                "timestamp": round(clock_ms),
                "input_length": turn.prompt_tokens,
                "output_length": turn.answer_tokens,
                "hash_ids": turn.prompt_hash_ids,
            }
        )
        clock_ms += generator.rng.expovariate(1.0 / MEAN_INTERARRIVAL_MS)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="number of requests")
    parser.add_argument("--seed", type=int, default=7, help="random seed")
    parser.add_argument("--out", default="-", help="output .jsonl path, or - for stdout")
    parser.add_argument("--block-tokens", type=int, default=512, help="tokens per hash id")
    parser.add_argument(
        "--max-prompt-blocks", type=int, default=30, help="longest prompt, in blocks"
    )
    args = parser.parse_args(argv)
    try:
        records = generate_workload(
            args.requests, args.seed, args.block_tokens, args.max_prompt_blocks
        )
    except ValueError as exc:
        parser.error(str(exc))
    text = "".join(json.dumps(record) + "\n" for record in records)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
