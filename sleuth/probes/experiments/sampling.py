"""The anchor sampler: support, order, duplicates, counts and padded slots."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sleuth.probes.experiments.lab import Lab, SAMPLER_DRAWS
from sleuth.probes.protocol import ProbeBatch
from sleuth.probes.verdict import Verdict


def _sampler_batch(lab: Lab) -> tuple[ProbeBatch, Tensor]:
    """The probe batch with a loss mask that starts unsupervised and has a hole in the middle (samplers that
    return ranks among eligible positions instead of positions land in the unsupervised start)."""
    batch = lab.batch
    mask = batch.loss_mask.clone()
    for n, row in enumerate(lab.layout.rows):
        mask[n, :5] = 0
        middle = row.length // 2
        mask[n, middle : middle + 3] = 0
    return batch.replace(loss_mask=mask), mask


def probe_anchor_sampling(lab: Lab) -> list[Verdict]:
    b = lab.block_size
    exclusions = list(lab.info.get("anchor_exclusions") or [])
    verdict = Verdict(
        invariant="dflash.anchor_sampling", experiment="anchor-sampling",
        hypothesis="anchors are drawn uniformly without replacement from the supervised positions (less the "
        "positions the implementation's documented rule excludes), sorted; padded slots are flagged invalid and "
        "carry no loss",
        perturbed=f"nothing: the subject's own sampler is called {SAMPLER_DRAWS} times on a loss mask with an "
        "unsupervised start and a hole, once on a mask supervised from position 0 to each row's end with as many "
        "anchors as there are eligible positions, and once on a nearly empty one",
        measurement="", threshold="exact support; duplicates, unsorted or unsupervised anchors count at once; "
        "balance of the two halves within 5 standard deviations",
        expected="uniform over the eligible positions, sorted, without replacement", status="unknown",
        coverage=lab.coverage(anchor_sampler=lab.info.get("anchor_sampler_source") or "the subject's sample_anchors",
                              draws=SAMPLER_DRAWS, documented_exclusions=exclusions),
    )
    sampler = getattr(lab.subject, "sample_anchors", None)
    if lab.facts.get("padded_anchor_trained"):
        verdict.status = "mismatch"
        verdict.observed = "the padded anchor slot (anchor_valid False) is trained"
        verdict.fix = "Zero the loss of blocks whose anchor is padding (anchor_valid False)."
        return [verdict]
    if not callable(sampler):
        verdict.reason = "not exercised: the subject's anchor sampler (it exposes no sample_anchors)"
        return [verdict]
    batch, mask = _sampler_batch(lab)
    eligible: list[set[int]] = []
    allowed: list[set[int]] = []
    for n, row in enumerate(lab.layout.rows):
        supervised = {p for p in range(row.length) if mask[n, p]}
        allowed.append(supervised)
        keep = set(supervised)
        if "last B positions" in exclusions:
            keep = {p for p in keep if p < lab.layout.seq_len - b}
        if "next token unsupervised" in exclusions:
            keep = {p for p in keep if p + 1 < row.length and mask[n, p + 1]}
        eligible.append(keep)
    smallest = min(len(e) for e in eligible)
    num = max(2, smallest // 2)
    counts = [dict.fromkeys(sorted(e), 0) for e in eligible]
    problems: list[str] = []
    for draw in range(SAMPLER_DRAWS):
        torch.manual_seed(lab.seed + 500 + draw)
        anchors, valid = sampler(batch, num)
        anchors, valid = anchors.reshape(-1, anchors.shape[-1]), valid.reshape(-1, valid.shape[-1]).bool()
        for n in range(min(lab.rows, anchors.shape[0])):
            picked = anchors[n][valid[n]].tolist()
            if len(picked) != len(set(picked)):
                problems.append(f"duplicate anchors in one draw (row {n}: {sorted(picked)[:10]})")
            if picked != sorted(picked):
                problems.append(f"anchors not sorted (row {n}: {picked[:10]})")
            if len(picked) != min(num, len(eligible[n])):
                problems.append(f"{len(picked)} valid anchors drawn where {min(num, len(eligible[n]))} were asked for "
                                f"and eligible (row {n})")
            outside = [p for p in picked if p not in allowed[n]]
            if outside:
                problems.append(f"anchors at unsupervised positions {outside[:6]} (row {n}; ranks among the eligible "
                                "positions returned as positions, or the mask ignored)")
            excluded = [p for p in picked if p in allowed[n] and p not in eligible[n]]
            if excluded:
                problems.append(f"anchors at positions the rule excludes ({', '.join(exclusions)}): {excluded[:6]} (row {n})")
            for p in picked:
                if p in counts[n]:
                    counts[n][p] += 1
        if problems:
            break
    never = [(n, p) for n, c in enumerate(counts) for p, k in c.items() if k == 0]
    skew = []
    for n, c in enumerate(counts):
        ordered = list(c.values())
        half = len(ordered) // 2
        low, high = sum(ordered[:half]), sum(ordered[len(ordered) - half :])
        if abs(low - high) > 5 * math.sqrt(max(low + high, 1)) / 2 + 2:
            skew.append((n, low, high))
    # More anchors asked for than one row has but fewer than another: each row gets what it can hold.
    sizes = sorted(len(e) for e in eligible)
    if len(sizes) > 1 and sizes[0] < sizes[-1] and not problems:
        between = (sizes[0] + sizes[-1]) // 2
        torch.manual_seed(lab.seed + 998)
        _anchors, some_valid = sampler(batch, between)
        some_valid = some_valid.reshape(-1, some_valid.shape[-1]).bool()
        got = [int(some_valid[n].sum()) for n in range(min(lab.rows, some_valid.shape[0]))]
        want = [min(between, len(e)) for e in eligible][: len(got)]
        if got != want:
            problems.append(f"asked for {between} anchors, rows with {[len(e) for e in eligible]} eligible positions got "
                            f"{got} valid anchors (expected {want}): one row's count limits another's")
    # Every position of each row supervised, from position 0 to the row's last token (pretraining-style or
    # prompt-less data), and as many anchors asked for as the largest row has eligible positions: each row must
    # get every eligible position back, flagged valid, once. The draws above start unsupervised, so a sampler
    # that loses an anchor at position 0 (a valid flag read off a zero-padded anchor tensor) or at the row's
    # end shows only here.
    full_mask = torch.zeros_like(mask)
    full_eligible: list[set[int]] = []
    for n, row in enumerate(lab.layout.rows):
        full_mask[n, : row.length] = 1
        keep = set(range(row.length))
        if "last B positions" in exclusions:
            keep = {p for p in keep if p < lab.layout.seq_len - b}
        if "next token unsupervised" in exclusions:
            keep = {p for p in keep if p + 1 < row.length}
        full_eligible.append(keep)
    if not problems and all(full_eligible):
        torch.manual_seed(lab.seed + 997)
        every = max(len(e) for e in full_eligible)
        all_anchors, all_valid = sampler(batch.replace(loss_mask=full_mask), every)
        all_anchors = all_anchors.reshape(-1, all_anchors.shape[-1])
        all_valid = all_valid.reshape(-1, all_valid.shape[-1]).bool()
        for n in range(min(lab.rows, all_anchors.shape[0])):
            got = all_anchors[n][all_valid[n]].tolist()
            if sorted(got) != sorted(full_eligible[n]):
                lost = sorted(full_eligible[n] - set(got))
                extra = sorted(set(got) - full_eligible[n])
                problems.append(f"with every position of row {n} supervised and {every} anchors asked for, the valid "
                                f"anchors miss eligible position(s) {lost[:6]}" + (f" and add {extra[:6]}" if extra else "")
                                + (" (position 0: a valid flag read off zero-padded anchors?)" if 0 in lost else ""))
                break
    # Fewer eligible positions than anchors asked for: the extra slots must be flagged invalid.
    sparse = mask.clone() * 0
    for n, row in enumerate(lab.layout.rows):
        sparse[n, 8:11] = 1
    torch.manual_seed(lab.seed + 999)
    few_anchors, few_valid = sampler(batch.replace(loss_mask=sparse), 6)
    few_valid = few_valid.reshape(-1, few_valid.shape[-1]).bool()
    flagged = [int(few_valid[n].sum()) for n in range(min(lab.rows, few_valid.shape[0]))]
    few_expected = []
    for n, row in enumerate(lab.layout.rows):
        keep = {8, 9, 10}
        if "next token unsupervised" in exclusions:
            keep = {p for p in keep if sparse[n, p + 1]}
        few_expected.append(min(6, len(keep)))
    verdict.measured = {"never_drawn": never[:20], "skew": skew, "sparse_valid": flagged}
    verdict.measurement = (f"{SAMPLER_DRAWS} draws of {num} anchors over {[len(e) for e in eligible]} eligible positions: "
                           f"{len(never)} eligible positions never drawn; halves "
                           + ", ".join(f"{lo}/{hi}" for _, lo, hi in skew) + f"; with 3 supervised positions and 6 "
                           f"asked, valid flags {flagged}")
    if flagged != few_expected[: len(flagged)]:
        problems.append(f"with fewer eligible positions than anchors, {flagged} slots are flagged valid "
                        f"(expected {few_expected}): padded slots are not kept invalid")
    if problems:
        verdict.status, verdict.observed = "mismatch", problems[0]
        verdict.fix = ("Draw anchors with randperm over the eligible positions (loss mask 1, the documented "
                       "exclusions), keep the first max_anchors, sort them, flag the rest invalid.")
    elif never:
        verdict.status = "mismatch"
        verdict.observed = (f"{len(never)} eligible positions are never drawn in {SAMPLER_DRAWS} draws (e.g. row "
                            f"{never[0][0]}, position {never[0][1]}): not uniform over the eligible positions")
    elif skew:
        verdict.status = "mismatch"
        verdict.observed = f"draws favour one half of the eligible positions ({skew[0][1]} vs {skew[0][2]})"
    else:
        verdict.status = "match"
        verdict.observed = "uniform over the eligible positions, sorted, without replacement, padded slots invalid"
        if not exclusions:
            verdict.not_exercised.append("the implementation's documented exclusions (the subject states none; "
                                         "anchors in the last B positions could not be judged)")
    return [verdict.gated()]
