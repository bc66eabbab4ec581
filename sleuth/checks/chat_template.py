"""`dflash.chat_template_consistency`: training data, eval prompts and the served drafter share one chat format.

A drafter learns the token statistics of the rendered training data. Rendered with another template, or
with thinking on where serving has it off (z-lab #133: thinking mode in the data), the drafter trains on
text the server never produces, and acceptance drops only when served. Three renderings are compared
where they are recorded (run-directory contract):

    training data   run.json `data.chat_template_sha256`, `data.chat_template_kwargs`
    eval prompts    eval.json `prompts.chat_template_sha256`, `prompts.chat_template_kwargs`
    served drafter  an exported directory's declared template (tokenizer_config.json `chat_template` or
                    chat_template.jinja), hashed the same way

Hashes are sha256 of the template text (UTF-8); kwargs are the extra template variables, e.g.
{"enable_thinking": false}. Null hashes mean the data was not rendered from chat messages.
"""

from __future__ import annotations

import hashlib
from typing import Any

from sleuth.checks.context import ContractContext, read_json
from sleuth.findings import Evidence, Finding, Fix

ID = "dflash.chat_template_consistency"


def template_sha256(template: str) -> str:
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def _declared_template(ctx: ContractContext) -> tuple[str | None, str | None]:
    if ctx.run is None:
        return None, None
    for name in ("tokenizer_config.json",):
        data = read_json(ctx.run.path / name) or {}
        if isinstance(data.get("chat_template"), str):
            return template_sha256(data["chat_template"]), str(ctx.run.path / name)
    jinja = ctx.run.path / "chat_template.jinja"
    if jinja.is_file():
        try:
            return template_sha256(jinja.read_text(encoding="utf-8")), str(jinja)
        except (OSError, UnicodeDecodeError):
            return None, None
    return None, None


def _recorded(holder: Any) -> tuple[str | None, dict[str, Any] | None]:
    if not isinstance(holder, dict):
        return None, None
    sha = holder.get("chat_template_sha256")
    kwargs = holder.get("chat_template_kwargs")
    return (sha if isinstance(sha, str) else None), (kwargs if isinstance(kwargs, dict) else None)


def check_chat_template_consistency(ctx: ContractContext) -> Finding:
    renderings: list[tuple[str, str, dict[str, Any] | None, str]] = []  # (what, sha, kwargs, location)
    if ctx.run is not None:
        sha, kwargs = _recorded((ctx.run.run_json or {}).get("data"))
        if sha:
            renderings.append(("training data", sha, kwargs, "run.json data.chat_template_sha256"))
        sha, kwargs = _recorded((ctx.run.eval_report or {}).get("prompts"))
        if sha:
            renderings.append(("eval prompts", sha, kwargs, "eval.json prompts.chat_template_sha256"))
    sha, location = _declared_template(ctx)
    if sha and location:
        renderings.append(("exported drafter", sha, None, location))
    if len(renderings) < 2:
        have = ", ".join(r[0] for r in renderings) or "none"
        return ctx.finding(ID, "unknown", reason=f"fewer than two chat renderings are recorded (have: {have}); "
                           "text data or a trainer that does not record its template")
    evidence = [Evidence(kind="config", location=loc, value=f"{sha[:12]} {kwargs or {}}") for _, sha, kwargs, loc in renderings]
    first_what, first_sha, first_kwargs, _ = renderings[0]
    differences = []
    for what, sha, kwargs, _ in renderings[1:]:
        if sha != first_sha:
            differences.append(f"{what} template {sha[:12]} differs from {first_what}'s {first_sha[:12]}")
        if kwargs is not None and first_kwargs is not None and kwargs != first_kwargs:
            differences.append(f"{what} renders with {kwargs} but {first_what} with {first_kwargs} (thinking mode?)")
    expected = "one template and one set of template kwargs (thinking mode) for training data, eval prompts and serving"
    if differences:
        return ctx.finding(ID, "mismatch", expected=expected, observed="; ".join(differences), evidence=evidence,
                           confidence=0.9, fix=Fix(code_hint="Render training data with the template (and "
                           "enable_thinking setting) the server uses, then retrain.", applicability="unsafe"))
    return ctx.finding(ID, "match", expected=expected, observed=f"{len(renderings)} renderings agree "
                       f"({', '.join(r[0] for r in renderings)})", evidence=evidence, confidence=0.85)
