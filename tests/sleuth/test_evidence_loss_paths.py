"""Loss-side readings claim a value only along its traced path: the gamma that reaches the decay, the
weighting that actually applies, the loss the default path calls, the candidate set anchors come from,
and the layer offset a read site adds. Each test plants one class of silent false match in a small
synthetic source (several styles) and checks the reading, and where it matters the verdict."""

from __future__ import annotations

from pathlib import Path

from sleuth.evidence.source import analyse_texts
from sleuth.invariants import check_invariants, load_playbook
from sleuth.trace import Trace


def readings(texts: dict[str, str], invariant: str) -> list[tuple[object, str]]:
    facts = analyse_texts((path, text, None) for path, text in texts.items())
    return [(r.value, r.mode) for r in facts.readings[invariant]]


def verdict(tmp_path: Path, texts: dict[str, str], invariant: str):
    for path, text in texts.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    findings = check_invariants(load_playbook(), reference=None, config=None, config_source=None, checkpoint=None,
                                code=tmp_path, trace=Trace())
    return next(f for f in findings if f.id == invariant)


# --- loss_decay_gamma: the gamma that reaches the decay ------------------------------------------------

DECAY_HELPER = (
    "import torch\n"
    "def slot_decay(slot, gamma):\n"
    "    w = torch.exp(-(slot - 1).clamp(min=0) / gamma)\n"
    "    return w * (slot != 0)\n"
)


def test_decay_applied_only_by_another_algorithm_is_no_decay(tmp_path: Path):
    # the DFlash loss uses flat weights; only the DSpark head still calls the decay helper
    dflash = ("import torch\n"
              "def dflash_objective(ce, slot, mask, gamma: float = 4.0):\n"
              "    weights = mask.float()  # flat while debugging\n"
              "    return (ce * weights).sum() / weights.sum()\n")
    dspark = ("from functools import partial\nfrom helpers import slot_decay\n"
              "def dspark_objective(ce, slot, gamma=4.0):\n"
              "    fn = partial(slot_decay, gamma=gamma)\n"
              "    return (ce * fn(slot)).mean()\n")
    texts = {"pkg/helpers.py": DECAY_HELPER, "pkg/dflash_loss.py": dflash, "pkg/dspark/loss.py": dspark}
    assert readings(texts, "dflash.loss_decay_gamma") == [("none", "hardcoded")]
    assert verdict(tmp_path, texts, "dflash.loss_decay_gamma").status == "mismatch"


def test_gamma_reaches_the_decay_through_partial_and_callers():
    caller = ("from functools import partial\nfrom helpers import slot_decay\n"
              "def loss_terms(ce, slot, gamma=7.0):\n"
              "    weigh = partial(slot_decay, gamma=gamma)\n"
              "    return ce * weigh(slot)\n")
    got = readings({"helpers.py": DECAY_HELPER, "loss.py": caller}, "dflash.loss_decay_gamma")
    assert got == [(7.0, "default")]


def test_a_default_every_caller_overrides_is_not_what_runs():
    code = ("import torch\n"
            "def weights(slot, gamma=4.0):\n"
            "    return torch.exp(-(slot - 1) / gamma) * (slot > 0)\n"
            "def step(ce, slot):\n"
            "    return (ce * weights(slot, gamma=7.0)).mean()\n")
    assert readings({"m.py": code}, "dflash.loss_decay_gamma") == [(7.0, "default")]


def test_an_exponent_multiplied_by_gamma_decays_with_its_inverse(tmp_path: Path):
    # exp(-(k-1) * gamma) with gamma 4 is a decay with gamma 1/4: every late slot almost vanishes
    code = ("import torch\n"
            "class Objective:\n"
            "    def __init__(self, gamma: float = 4.0):\n"
            "        self.gamma = gamma\n"
            "    def loss(self, ce, pos_in_block):\n"
            "        w = torch.exp(-(pos_in_block - 1).clamp(min=0) * self.gamma) * (pos_in_block > 0)\n"
            "        return (ce * w).sum()\n")
    assert readings({"m.py": code}, "dflash.loss_decay_gamma") == [(0.25, "default")]
    assert verdict(tmp_path, {"m.py": code}, "dflash.loss_decay_gamma").status == "mismatch"


def test_constructor_arguments_kept_as_hyperparameters_reach_the_decay():
    code = ("import torch\n"
            "class Module:\n"
            "    def __init__(self, block=8, decay=4.0):\n"
            "        self.save_hyperparameters()\n"
            "    def training_step(self, ce, slot):\n"
            "        w = torch.exp(-(slot - 1).float() / self.hparams.decay) * (slot > 0)\n"
            "        return (ce * w).mean()\n")
    assert readings({"m.py": code}, "dflash.loss_decay_gamma") == [(4.0, "default")]


# --- anchor_slot_untrained: the weighting that actually applies -----------------------------------------

def test_slot_zero_excluded_only_in_one_weighting_branch_is_not_a_match(tmp_path: Path):
    code = ("import torch\nfrom functools import partial\n"
            + DECAY_HELPER +
            "def confidence_weights(slot, ce):\n"
            "    return torch.cumprod(torch.exp(-ce), dim=-1)\n"
            "def objective(ce, slot, mask, weighting='decay', gamma=4.0):\n"
            "    if weighting == 'confidence':\n"
            "        weigh = partial(confidence_weights, ce=ce)\n"
            "    else:\n"
            "        weigh = partial(slot_decay, gamma=gamma)\n"
            "    loss = ce * mask * weigh(slot)\n"
            "    return loss.sum() / mask.sum()\n")
    got = readings({"m.py": code}, "dflash.anchor_slot_untrained")
    assert ("weight 0", "switch") in got and ("trained", "switch") in got
    assert verdict(tmp_path, {"m.py": code}, "dflash.anchor_slot_untrained").status == "unknown"
    # zeroing slot 0 on the common path (the loss mask) covers both branches
    common = code.replace("    loss = ce * mask", "    mask[:, 0] = 0\n    loss = ce * mask")
    assert verdict(tmp_path, {"m.py": common}, "dflash.anchor_slot_untrained").static_agreement


def test_a_slot_mask_that_keeps_slot_zero_trains_it(tmp_path: Path):
    code = ("import torch\n"
            "def block_loss(ce, valid, block_size):\n"
            "    pos_in_block = torch.arange(block_size).view(1, 1, -1)\n"
            "    weight_mask = valid.float() * (pos_in_block >= 0).float()\n"
            "    return (ce * weight_mask).sum() / weight_mask.sum()\n")
    assert readings({"m.py": code}, "dflash.anchor_slot_untrained") == [("trained", "hardcoded")]
    assert verdict(tmp_path, {"m.py": code}, "dflash.anchor_slot_untrained").status == "mismatch"
    fixed = code.replace(">= 0", "> 0")
    assert verdict(tmp_path, {"m.py": fixed}, "dflash.anchor_slot_untrained").static_agreement


def test_a_clamped_decay_with_nothing_zeroing_slot_zero_trains_it():
    code = ("import torch\n"
            "def weighted_loss(ce, pos_idx, gamma=4.0):\n"
            "    w = torch.exp(-((pos_idx - 1).clamp(min=0)) / gamma)\n"
            "    return (ce * w).mean()\n")
    assert readings({"m.py": code}, "dflash.anchor_slot_untrained") == [("trained", "hardcoded")]


# --- loss_kind: the loss the default path calls ---------------------------------------------------------

def test_hand_written_squared_error_as_the_default_loss_is_a_regression(tmp_path: Path):
    code = ("import torch\n"
            "DEFAULT_LOSSES = {'sq': (lambda logits, targets: (logits - targets).pow(2).mean(dim=-1), 1.0)}\n"
            "def norm(x):\n"
            "    return (x - x.mean(-1, keepdim=True)).pow(2).mean(-1)  # a variance, not an objective\n"
            "def loss(logits, targets, terms=None):\n"
            "    terms = terms or DEFAULT_LOSSES\n"
            "    return sum(w * fn(logits, targets) for fn, w in terms.values())\n")
    assert readings({"m.py": code}, "dflash.loss_kind") == [("regression (squared error)", "hardcoded")]
    assert verdict(tmp_path, {"m.py": code}, "dflash.loss_kind").status == "mismatch"


def test_losses_picked_by_name_from_a_registry_are_switches(tmp_path: Path):
    code = ("import torch.nn.functional as F\n"
            "def kl_term(logits, targets):\n"
            "    return F.kl_div(F.log_softmax(logits, -1), F.softmax(targets, -1), reduction='none').sum(-1)\n"
            "def ce_term(logits, targets):\n"
            "    return F.cross_entropy(logits.flatten(0, 1), targets.argmax(-1).flatten(), reduction='none')\n"
            "TERMS = {'kl': kl_term, 'ce': ce_term}\n"
            "def loss(logits, targets, name):\n"
            "    return TERMS[name](logits, targets).mean()\n")
    got = readings({"m.py": code}, "dflash.loss_kind")
    assert sorted(got) == [("ce", "switch"), ("kl", "switch")]
    assert verdict(tmp_path, {"m.py": code}, "dflash.loss_kind").status == "unknown"


def test_an_accepted_alternative_says_so(tmp_path: Path):
    code = ("import torch.nn.functional as F\n"
            "def distill_loss(logits, targets):\n"
            "    return F.kl_div(F.log_softmax(logits, -1), F.softmax(targets, -1), reduction='batchmean')\n")
    finding = verdict(tmp_path, {"m.py": code}, "dflash.loss_kind")
    assert finding.static_agreement and finding.observed == "kl"
    assert finding.expected == "ce (or accepted: kl)" and "accepts" in finding.reason


# --- anchor_sampling: the candidate set ------------------------------------------------------------------

SAMPLER = ("import torch\n"
           "def pick(valid, block, cap):\n"
           "    cand = valid.bool().clone()\n"
           "    cand[:, -block:] = False\n"
           "    idx = cand[0].nonzero().squeeze(-1)\n"
           "    return idx[torch.randperm(idx.numel())[:cap]].sort().values\n"
           "def step(batch, block):\n"
           "    anchors = pick(batch['loss_mask'], block, 512)\n"
           "    return anchors\n")


def test_anchor_candidates_are_traced_to_the_loss_mask(tmp_path: Path):
    assert readings({"m.py": SAMPLER}, "dflash.anchor_sampling") == [("uniform without replacement", "hardcoded")]
    assert verdict(tmp_path, {"m.py": SAMPLER}, "dflash.anchor_sampling").static_agreement


def test_anchors_from_every_position_ignore_the_loss_mask(tmp_path: Path):
    ones = SAMPLER.replace("cand = valid.bool().clone()", "cand = torch.ones_like(valid, dtype=torch.bool)")
    assert readings({"m.py": ones}, "dflash.anchor_sampling") == [("uniform over every position (loss mask ignored)", "hardcoded")]
    assert verdict(tmp_path, {"m.py": ones}, "dflash.anchor_sampling").status == "mismatch"
    noise = ("import torch\n"
             "def anchors_of(loss_mask, n):\n"
             "    valid = loss_mask > 0.5\n"
             "    scores = torch.rand(valid.shape)\n"
             "    return scores.argsort(dim=1)[:, :n]\n")
    assert readings({"m.py": noise}, "dflash.anchor_sampling") == [("uniform over every position (loss mask ignored)", "hardcoded")]
    masked = noise.replace("    return", "    scores.masked_fill_(~valid, 2.0)\n    return")
    assert "loss mask ignored" not in readings({"m.py": masked}, "dflash.anchor_sampling")[0][0]


def test_anchors_allowed_in_the_last_block_are_flagged(tmp_path: Path):
    no_cut = SAMPLER.replace("    cand[:, -block:] = False\n", "")
    assert readings({"m.py": no_cut}, "dflash.anchor_sampling") == [
        ("uniform without replacement, last B positions not excluded", "hardcoded")]
    assert verdict(tmp_path, {"m.py": no_cut}, "dflash.anchor_sampling").status == "mismatch"
    # a slice that ends before the tail is a cut too
    sliced = no_cut.replace("idx = cand[0].nonzero()", "idx = cand[0, : cand.shape[1] - block].nonzero()")
    assert readings({"m.py": sliced}, "dflash.anchor_sampling") == [("uniform without replacement", "hardcoded")]


# --- target_layer_ids: the offset a read site adds ------------------------------------------------------

LAYERS = ("def layer_ids(n_layers, n_draft):\n"
          "    if n_draft == 1:\n        return [n_layers // 2]\n"
          "    lo, hi = 1, n_layers - 3\n"
          "    return [round(lo + i * (hi - lo) / (n_draft - 1)) for i in range(n_draft)]\n"
          "def features(hidden_states, ids):\n"
          "    shift = 1\n"
          "    return [hidden_states[shift + i] for i in ids]\n"
          "class Drafter:\n"
          "    def __init__(self, cfg):\n"
          "        self.ids = cfg.get('ids', layer_ids(cfg['L'], cfg['k']))\n"
          "def run(model, target, x):\n"
          "    out = target(x, output_hidden_states=True)\n"
          "    return features(out.hidden_states, model.ids)\n")


def test_a_read_offset_held_in_a_name_is_read_by_value(tmp_path: Path):
    assert [v for v, _ in readings({"m.py": LAYERS}, "dflash.target_layer_ids")] == ["evenly-1-to-L-3"]
    zero = LAYERS.replace("shift = 1", "shift = 0")
    got = [v for v, _ in readings({"m.py": zero}, "dflash.target_layer_ids")]
    assert "custom (read at hidden_states[i+0])" in got
    assert verdict(tmp_path, {"m.py": zero}, "dflash.target_layer_ids").status == "mismatch"


def test_gamma_through_a_settings_object_built_from_the_config(tmp_path: Path):
    # the decay's gamma is a plan field set from the config; the other weighting mode passes None (unused)
    code = ("import torch\nfrom dataclasses import dataclass\n"
            "@dataclass\nclass Config:\n    decay: float = 4.0\n    weighting: str = 'decay'\n"
            "@dataclass\nclass Plan:\n    gamma: float | None\n    weighting: str\n"
            "    @classmethod\n    def build(cls, config):\n        return cls(gamma=config.decay, weighting=config.weighting)\n"
            "def slot_weights(B, gamma):\n"
            "    k = torch.arange(B)\n"
            "    w = torch.ones(B) if gamma is None else torch.exp(-(k - 1).clamp(min=0) / gamma)\n"
            "    w[0] = 0.0\n    return w\n"
            "def step(plan, ce):\n"
            "    gamma = plan.gamma if plan.weighting == 'decay' else None\n"
            "    return (ce * slot_weights(8, gamma)).sum()\n")
    assert readings({"m.py": code}, "dflash.loss_decay_gamma") == [(4.0, "default")]
    assert verdict(tmp_path, {"m.py": code}, "dflash.loss_decay_gamma").static_agreement


# --- target_logits_source: a teacher cut out of the fused features ----------------------------------------

def test_a_teacher_sliced_from_the_fused_features_is_an_intermediate_layer(tmp_path: Path):
    code = ("import torch\nfrom torch import nn\n"
            "class Drafter(nn.Module):\n"
            "    def __init__(self, hidden, n_layers, vocab):\n"
            "        super().__init__()\n"
            "        self.hidden = hidden\n"
            "        self.fuse = nn.Linear(n_layers * hidden, hidden, bias=False)\n"
            "        self.head = nn.Linear(hidden, vocab, bias=False)\n"
            "        self.final_norm = nn.RMSNorm(hidden)\n"
            "    def forward(self, features, teacher_state):\n"
            "        context = self.fuse(features)\n"
            "        teacher_state = features[..., -self.hidden:]  # stands in for the target's last state\n"
            "        with torch.no_grad():\n"
            "            targets = self.head(self.final_norm(teacher_state))\n"
            "        return context, targets\n")
    got = readings({"m.py": code}, "dflash.target_logits_source")
    assert ("intermediate", "hardcoded") in got
    assert verdict(tmp_path, {"m.py": code}, "dflash.target_logits_source").status == "mismatch"
