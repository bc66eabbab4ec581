"""What the train-to-serve contract checks read: the run, its target's files, the findings so far.

Import-light on purpose: plain JSON and safetensors headers only. A check that needs torch (recomputing
hidden states) imports it itself, only when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sleuth.findings import Evidence, Finding, Fix, Severity, Status
from sleuth.runs import RunInfo


@dataclass
class ContractContext:
    """Everything the contract checks may read; every field may be missing."""

    run: RunInfo | None = None
    config: dict[str, Any] | None = None  # the run's config.json, an exported config.json or --config
    config_source: str | None = None
    target_dir: Path | None = None  # --target: the target / verifier model directory
    hidden_states: Path | None = None  # --hidden-states: an offline hidden-state cache
    served_by: str | None = None  # --served-by: the engine the user serves with (playbooks/serving/engines.yaml)
    checkpoint: Path | None = None  # --checkpoint, else the run's own (an export's model.safetensors)
    findings: list[Finding] = field(default_factory=list)  # what the other checks of this diagnosis found
    rules: dict[str, Any] = field(default_factory=dict)  # playbook invariants by id (title, severity)

    def checkpoint_path(self) -> Path | None:
        if self.checkpoint is not None:
            return self.checkpoint
        return self.run.checkpoint if self.run is not None else None

    def tensors(self) -> dict[str, Any]:
        """Tensor name -> TensorInfo from the checkpoint's safetensors header ({} when there is none or it
        cannot be read: the checks that need it then say so)."""
        if "_tensors" not in self.__dict__:
            from sleuth.evidence.checkpoint import CheckpointError, read_header

            path = self.checkpoint_path()
            try:
                self.__dict__["_tensors"] = read_header(path) if path is not None else {}
            except CheckpointError:
                self.__dict__["_tensors"] = {}
        return self.__dict__["_tensors"]

    @property
    def variant(self) -> Any:
        """The DFlash-family variant under diagnosis (sleuth.evidence.variant.Variant), read once."""
        if "_variant" not in self.__dict__:
            from sleuth.evidence.variant import detect_variant

            run_json = self.run.run_json if self.run is not None else None
            where = Path(self.config_source).name if self.config_source else "config.json"
            self.__dict__["_variant"] = detect_variant(self.config, run_json=run_json, tensor_names=self.tensors(),
                                                       where=where)
        return self.__dict__["_variant"]

    def finding(self, invariant_id: str, status: Status, *, expected: str | None = None,
                observed: str | None = None, evidence: list[Evidence] | None = None, confidence: float = 0.9,
                reason: str | None = None, notes: list[str] | None = None, fix: Fix | None = None,
                fallback_title: str = "", fallback_severity: Severity = "high") -> Finding:
        rule = self.rules.get(invariant_id)
        return Finding(
            id=invariant_id,
            title=getattr(rule, "title", None) or fallback_title or invariant_id,
            status=status,
            severity=getattr(rule, "severity", None) or fallback_severity,
            expected=expected,
            observed=observed,
            evidence=evidence or [],
            confidence=confidence if status != "unknown" else 0.0,
            fix=fix,
            reason=reason,
            notes=notes or [],
        )

    # --- the target --------------------------------------------------------------------------------

    def resolve_target_dir(self) -> tuple[Path | None, str]:
        """The target's model directory and where its name came from; (None, why) when there is none."""
        if self.target_dir is not None:
            return (self.target_dir, "--target") if self.target_dir.is_dir() else (None, f"--target {self.target_dir} is not a directory")
        candidates: list[tuple[str, Any]] = []
        if self.run is not None and isinstance(self.run.run_json, dict):
            target = self.run.run_json.get("target")
            if isinstance(target, dict):
                candidates.append(("run.json target.path", target.get("path")))
        verifier = ((self.config or {}).get("speculators_config") or {}).get("verifier") or {}
        if isinstance(verifier, dict):
            candidates.append(("config.json speculators_config.verifier.name_or_path", verifier.get("name_or_path")))
        for source, value in candidates:
            if isinstance(value, str) and value:
                path = Path(value).expanduser()
                if not path.is_absolute() and self.run is not None:
                    # A relative path was relative to where the trainer ran; try the run's parent too.
                    path = path if path.is_dir() else self.run.path.parent / path
                if path.is_dir():
                    return path, source
                return None, f"{source} names {value!r}, which is not a directory here (name it with --target DIR)"
        return None, "no target directory is recorded (name it with --target DIR)"


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from a model directory beside the run, under sleuth.artifacts' discipline (regular files
    only, bounded); None when missing or damaged. A tokenizer.json of a large vocabulary is tens of MiB."""
    from sleuth.artifacts import optional_json_object

    return optional_json_object(path, None, max_bytes=256 * 1024 * 1024)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []  # a damaged file's field of another type reads as empty


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs nest the language model's settings under text_config."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def int_list(value: Any) -> list[int]:
    if int_or_none(value) is not None:
        return [value]
    if isinstance(value, list):
        return [v for v in value if int_or_none(v) is not None]
    return []


@dataclass
class TokenizerFacts:
    """Special token ids of a target, read from its JSON files (no tokenizer library needed)."""

    special: dict[str, list[int]]  # "eos" / "pad" / "bos" / "mask" -> ids, with where each came from
    sources: dict[str, str]
    vocab_size: int | None  # embedding rows (config.json)
    tokenizer_size: int | None  # ids the tokenizer can produce (base vocab + added tokens)
    chat_template: str | None


def _token_id(token: Any, vocab: dict[str, int], added: dict[str, int]) -> int | None:
    if isinstance(token, dict):  # {"content": "<|endoftext|>", ...} in older tokenizer_config files
        token = token.get("content")
    if not isinstance(token, str):
        return None
    return added.get(token, vocab.get(token))


def tokenizer_facts(target_dir: Path) -> TokenizerFacts:
    config = text_config(read_json(target_dir / "config.json") or {})
    generation = read_json(target_dir / "generation_config.json") or {}
    tokenizer_json = read_json(target_dir / "tokenizer.json") or {}
    tokenizer_config = read_json(target_dir / "tokenizer_config.json") or {}
    special_map = read_json(target_dir / "special_tokens_map.json") or {}
    model = tokenizer_json.get("model") if isinstance(tokenizer_json.get("model"), dict) else {}
    vocab = model.get("vocab") if isinstance(model.get("vocab"), dict) else {}
    added = {
        t["content"]: t["id"] for t in _list(tokenizer_json.get("added_tokens"))
        if isinstance(t, dict) and isinstance(t.get("content"), str) and int_or_none(t.get("id")) is not None
    }
    decoder = tokenizer_config.get("added_tokens_decoder")
    for key, entry in (decoder if isinstance(decoder, dict) else {}).items():
        if isinstance(entry, dict) and isinstance(entry.get("content"), str) and str(key).isdecimal() and len(str(key)) < 12:
            added.setdefault(entry["content"], int(key))
    special: dict[str, list[int]] = {}
    sources: dict[str, str] = {}

    def note(kind: str, ids: list[int], source: str) -> None:
        new = [i for i in ids if i not in special.get(kind, [])]
        if new:
            special.setdefault(kind, []).extend(new)
            sources[kind] = ", ".join(filter(None, [sources.get(kind), source]))

    for kind in ("eos", "pad", "bos", "mask"):
        for name, holder in (("tokenizer_config.json", tokenizer_config), ("special_tokens_map.json", special_map)):
            token_id = _token_id(holder.get(f"{kind}_token"), vocab, added)
            if token_id is not None:
                note(kind, [token_id], f"{name} {kind}_token")
        if kind != "mask":
            note(kind, int_list(config.get(f"{kind}_token_id")), f"config.json {kind}_token_id")
            note(kind, int_list(generation.get(f"{kind}_token_id")), f"generation_config.json {kind}_token_id")
    ids = list(vocab.values()) + list(added.values())
    template = tokenizer_config.get("chat_template")
    if not isinstance(template, str):
        jinja = target_dir / "chat_template.jinja"
        template = jinja.read_text(encoding="utf-8") if jinja.is_file() else None
    return TokenizerFacts(
        special=special,
        sources=sources,
        vocab_size=int_or_none(config.get("vocab_size")),
        tokenizer_size=(max(ids) + 1) if ids else None,
        chat_template=template,
    )
