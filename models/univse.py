"""UniVSE: Unified Visual-Semantic Embeddings: Bridging Vision and Language with Structured
Meaning Representations (Wu, Jiang, Mao, Ma, Wang; CVPR 2019).

- Words (sec. 3.2): a basic embedding ``w^(basic)`` (d_basic, from GloVe with ``glove``,
  else random) and a modifier embedding ``w^(modif)`` (d_modif, learned) per word.
- phi (sec. 3.2): ``Norm(sigmoid(W1 w + b1) * tanh(W2 w + b2))`` on ``w_n^(basic) (+)
  w_n^(modif)`` for a noun (u_obj), ``w_n^(basic) (+) w_a^(modif)`` for an (adjective,
  noun) pair (u_attr).
- psi (sec. 3.2): one GRU, its normalised last state; ``u_rel = psi(phi(w_s), phi(w_r),
  phi(w_o))``, ``u_sent = psi(phi(w_1), .., phi(w_k))``. phi and psi are shared by all levels.
- ``u_comp = Norm(sum of u_obj, u_attr, u_rel)`` (Phi = sum: Norm removes the length, so
  sum and mean agree), ``u_cap = alpha u_sent + (1 - alpha) u_comp``, alpha = 0.75.
- Image (sec. 3.3): the 1x1 convolution is a Linear on the ``(B, G, Dg)`` grid cells, the
  regions V ``(B, G, d)``; v is their normalised average. The score is the cosine.
- Negatives (sec. 3.4), from ``DataInfo.negatives``: nouns not in the caption (nor, fn. 2,
  in the batch's other captions of its image); (adjective, noun) pairs with one part
  substituted; triples with subject, predicate or object substituted. A negative always
  differs from its positive; one that cannot (an exhausted vocabulary) is dropped.
- Losses: eq. 1 (hardest negatives, F = max) for ``l_sent`` and ``l_comp``; eq. 1 with
  textual negatives only (fn. 3) for ``l_rel``; eq. 2-3 (relevance-weighted region
  alignment) for ``l_obj`` and ``l_attr``; eq. 4 with the etas of sec. 3.5 (``UniVSE.etas``).
  Every term is summed (over the batch, as VSE++'s code, or over all components).

Multi-word phrases: an object or attribute phrase's embeddings are the means over its
words; a multi-word predicate enters psi one phi(word) per step.

No official code was found, and the supplement was not seen. Choices the paper leaves open:
margin 0.2 (VSE++'s) and d_modif 300; average pooling for v over the fixed ResNet's
precomputed grid; the relevance map M of eq. 2 not detached; Phi = sum; training with the
shared ``train`` section (paper: Adam, lr 1e-3).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from torch import nn

from infra.config import Section
from models.common import cosine_sim, float32_scores, full_precision, l2norm
from models.data.info import DataInfo

NEGATIVE_KINDS = ("nouns", "adjectives", "relations")


class UniVSEConfig(Section):
    """``models.univse``; defaults are the paper's where it gives them (see each field)."""

    embed_size: PositiveInt = 1024  # d, the unified VSE space (sec. 3.5)
    d_basic: PositiveInt = 300  # w^(basic), GloVe-initialised (sec. 3.2): GloVe's 300-d
    # w^(modif): the paper defers its size to the supplement; same size as the basic part
    d_modif: PositiveInt = 300
    alpha: float = Field(0.75, ge=0.0, le=1.0)  # u_cap = alpha u_sent + (1-alpha) u_comp
    margin: PositiveFloat = 0.2  # delta of eq. 1 and 3 (VSE++'s, the paper's base [11])
    # eq. 4 weights, sec. 3.5: eta_c = eta_o = eta_a = 0.5 throughout; eta_r = 0 during the
    # first rel_start_epoch epochs ("the first 2 epochs"), then eta_r = 1.0
    eta_comp: NonNegativeFloat = 0.5
    eta_obj: NonNegativeFloat = 0.5
    eta_attr: NonNegativeFloat = 0.5
    eta_rel: NonNegativeFloat = 1.0
    eta_rel_start: NonNegativeFloat = 0.0
    rel_start_epoch: NonNegativeInt = 2
    glove: str | None = None  # GloVe text file for w^(basic), read before training


def load_glove(path: str | Path, words: list[str]) -> np.ndarray:
    """GloVe text file (``word v1 .. vD`` per line) -> ``(len(words), D)`` float32 rows for
    ``words``, NaN rows for the words the file does not have (``init_basic_embeddings``
    keeps those random). The first occurrence of a word wins."""
    wanted = {w: i for i, w in enumerate(words)}
    out: np.ndarray | None = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.rstrip("\n").rstrip(" ").split(" ")
            if out is None:
                if len(parts) < 2:
                    continue
                out = np.full((len(words), len(parts) - 1), np.nan, dtype=np.float32)
            dim = out.shape[1]
            if len(parts) < dim + 1:
                continue
            word = " ".join(parts[: len(parts) - dim])  # some GloVe words contain spaces
            i = wanted.get(word)
            if i is not None and np.isnan(out[i, 0]):
                out[i] = np.asarray(parts[len(parts) - dim :], dtype=np.float32)
    if out is None:
        raise ValueError(f"{path}: no GloVe vectors in this file")
    return out


class GatedFusion(nn.Module):
    """phi of sec. 3.2: ``Norm(sigmoid(W1 w + b1) * tanh(W2 w + b2))``."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.gate = nn.Linear(in_dim, out_dim)  # W1, b1
        self.value = nn.Linear(in_dim, out_dim)  # W2, b2

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return l2norm(torch.sigmoid(self.gate(w)) * torch.tanh(self.value(w)))


def ranking_loss(
    img: torch.Tensor, txt: torch.Tensor, margin: float, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Eq. 1: bidirectional hinge with the hardest negative (F = max) of each direction,
    summed over the positive pairs. ``img, txt (B, d)`` normalised, row b a positive pair;
    ``valid (B,)`` drops pairs (a caption with no components) both as positives and as
    negatives, which equals eq. 1 on the valid subset. Scores in float32 (autocast off)."""
    with float32_scores(img.device.type):
        img, txt = full_precision(img, txt)
        scores = img @ txt.t()  # (B, B): s(u_c, v_i) at [i, c]
        n = img.size(0)
        diagonal = scores.diag()
        eye = torch.eye(n, dtype=torch.bool, device=scores.device)
        valid = torch.ones(n, dtype=torch.bool, device=scores.device) if valid is None else valid
        negative = ~eye & valid[:, None] & valid[None, :]  # (B, B)
        cost_caption = (margin + scores - diagonal[:, None]).clamp(min=0)  # image i vs caption c'
        cost_image = (margin + scores - diagonal[None, :]).clamp(min=0)  # caption c vs image i'
        cost_caption = cost_caption.masked_fill(~negative, 0).amax(1)  # (B,)
        cost_image = cost_image.masked_fill(~negative, 0).amax(0)  # (B,)
        return (cost_caption + cost_image).sum()  # an invalid pair has no negative: 0


def region_alignment(
    regions: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, margin: float
) -> torch.Tensor:
    """Eq. 2-3: ``sum_i M_i [delta + s(u^-, V_i) - s(u^+, V_i)]_+`` with the relevance map
    ``M = softmax_i s(u^+, V_i)``. ``regions (B, G, d)``, ``pos / neg (B, N, d)`` all
    normalised -> ``(B, N)``, one value per (positive, negative) descriptor; the scores
    (softmax and hinge) in float32."""
    with float32_scores(regions.device.type):
        regions, pos, neg = full_precision(regions, pos, neg)
        s_pos = torch.einsum("bnd,bgd->bng", pos, regions)  # (B, N, G)
        s_neg = torch.einsum("bnd,bgd->bng", neg, regions)  # (B, N, G)
        relevance = s_pos.softmax(dim=-1)  # M, eq. 2
        return (relevance * (margin + s_neg - s_pos).clamp(min=0)).sum(-1)  # eq. 3


def relation_loss(
    img: torch.Tensor,
    pos: torch.Tensor,
    neg: torch.Tensor,
    mask: torch.Tensor,
    neg_valid: torch.Tensor,
    margin: float,
) -> torch.Tensor:
    """``l_rel``: eq. 1 with textual negatives only (footnote 3). Each relation ``(b, r)``
    of ``pos (B, R, d)`` faces its image ``img[b] (B, d)``; its hardest negative is the max
    of its sampled triple ``neg[b, r]`` (where ``neg_valid``) and every relation of the
    batch's other captions ("triples of captions which describe other images", sec. 3.4).
    Summed over the valid relations of ``mask (B, R)``; scores in float32."""
    b, r = mask.shape
    with float32_scores(img.device.type):
        img, pos, neg = full_precision(img, pos, neg)
        s_pos = torch.einsum("brd,bd->br", pos, img)  # (B, R)
        s_neg = torch.einsum("brd,bd->br", neg, img).masked_fill(~neg_valid, float("-inf"))
        cross = img @ pos.reshape(b * r, -1).t()  # (B, B*R): image b vs relation (b', r')
        owner = torch.arange(b, device=img.device).repeat_interleave(r)  # (B*R,)
        other = mask.reshape(1, b * r) & (
            owner[None, :] != torch.arange(b, device=img.device)[:, None]
        )
        hardest_batch = cross.masked_fill(~other, float("-inf")).amax(1)  # (B,)
        hardest = torch.maximum(s_neg, hardest_batch[:, None])  # (B, R)
        cost = (margin + hardest - s_pos).clamp(min=0)
        return torch.where(mask, cost, torch.zeros_like(cost)).sum()


def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the last (word) axis of phrase ids to ``width``."""
    return F.pad(x, (0, width - x.size(-1)))


def _swap(replace: torch.Tensor, new: torch.Tensor, old: torch.Tensor, width: int):
    """Phrase ids ``new`` where ``replace (...)``, else ``old``; both padded to ``width``."""
    return torch.where(replace.unsqueeze(-1), _pad_to(new, width), _pad_to(old, width))


def _phrase_equal(a: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """``a (..., Wa)`` phrase ids vs ``vocab (K, Wv)`` -> ``(..., K)`` exact equality."""
    w = max(a.size(-1), vocab.size(-1))
    return (_pad_to(a, w).unsqueeze(-2) == _pad_to(vocab, w)).all(-1)


def _gather_phrases(phrases: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``phrases (B, O, W)``, ``index (B, N)`` -> ``(B, N, W)`` the indexed phrases."""
    return phrases.gather(1, index[..., None].expand(-1, -1, phrases.size(-1)))


def _sample(allowed: torch.Tensor, generator: torch.Generator | None):
    """One uniform draw per row of ``allowed (..., K)`` among its True entries ->
    ``(index (...), valid (...))``; rows with no allowed entry are not valid."""
    shape, k = allowed.shape[:-1], allowed.size(-1)
    valid = allowed.any(-1)
    flat = allowed.reshape(-1, k)
    if flat.size(0) == 0:
        return torch.zeros(shape, dtype=torch.long, device=allowed.device), valid
    weights = torch.where(valid.reshape(-1, 1), flat, torch.ones_like(flat)).float()
    index = torch.multinomial(weights, 1, generator=generator).reshape(shape)
    return index, valid


class UniVSE(nn.Module):
    """The UniVSE model (see the module docstring)."""

    name = "univse"
    Config = UniVSEConfig
    inputs = frozenset({"grid", "words", "scene_graph"})

    def __init__(self, cfg: UniVSEConfig, info: DataInfo):
        super().__init__()
        self.cfg = cfg
        d = cfg.embed_size
        self.conv = nn.Linear(info.grid_dim, d)  # the 1x1 convolution (sec. 3.3)
        self.basic = nn.Embedding(info.vocab_size, cfg.d_basic, padding_idx=0)  # w^(basic)
        self.modif = nn.Embedding(info.vocab_size, cfg.d_modif, padding_idx=0)  # w^(modif)
        self.phi = GatedFusion(cfg.d_basic + cfg.d_modif, d)
        self.psi = nn.GRU(d, d, batch_first=True)
        nn.init.uniform_(self.basic.weight, -0.1, 0.1)
        nn.init.uniform_(self.modif.weight, -0.1, 0.1)
        with torch.no_grad():
            self.basic.weight[0].zero_()
            self.modif.weight[0].zero_()
        r = (6.0 / (info.grid_dim + d)) ** 0.5  # Xavier, as VSE++'s image FC
        nn.init.uniform_(self.conv.weight, -r, r)
        nn.init.zeros_(self.conv.bias)
        # negative-sampling vocabularies (K, W) word ids; an all-zero row is never drawn
        for component in NEGATIVE_KINDS:
            phrases = info.negatives.get(component, []) or [[0]]
            width = max(len(p) for p in phrases)
            ids = torch.tensor([list(p) + [0] * (width - len(p)) for p in phrases])
            self.register_buffer(f"neg_{component}", ids.long(), persistent=False)

    # ---- GloVe (sec. 3.2) ---------------------------------------------------------------

    @torch.no_grad()
    def init_basic_embeddings(self, matrix: np.ndarray | torch.Tensor) -> int:
        """Copy the finite rows of ``matrix (vocab_size, d_basic)`` (``load_glove``'s
        output) into w^(basic); NaN rows (words GloVe lacks) keep their random init.
        Returns the number of rows copied."""
        matrix = torch.as_tensor(np.asarray(matrix, dtype=np.float32))
        if tuple(matrix.shape) != tuple(self.basic.weight.shape):
            raise ValueError(
                f"GloVe matrix is {tuple(matrix.shape)}, the basic embeddings are "
                f"{tuple(self.basic.weight.shape)} (vocab_size, d_basic): set d_basic to the "
                "GloVe dimension"
            )
        found = torch.isfinite(matrix).all(1)
        found[0] = False  # <pad> stays zero
        self.basic.weight[found] = matrix[found].to(self.basic.weight)
        return int(found.sum())

    def prepare(self, data, log=print) -> None:
        """Before training a fresh model: w^(basic) from the ``glove`` file, if given, for
        the words of the training data's vocabulary (``data.word_index``)."""
        if self.cfg.glove:
            rows = self.init_basic_embeddings(load_glove(self.cfg.glove, list(data.word_index)))
            log(f"univse: {rows} basic word embeddings initialised from {self.cfg.glove}")

    # ---- encoders (sec. 3.2-3.3) --------------------------------------------------------

    def _parts(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Phrase ids ``(..., W)`` -> mean basic ``(..., d_basic)`` and mean modifier
        ``(..., d_modif)`` embeddings over the phrase's words (padding excluded)."""
        mask = (ids != 0).to(self.basic.weight.dtype).unsqueeze(-1)  # (..., W, 1)
        count = mask.sum(-2).clamp_min(1.0)
        return (
            (self.basic(ids) * mask).sum(-2) / count,
            (self.modif(ids) * mask).sum(-2) / count,
        )

    def encode_object(self, ids: torch.Tensor) -> torch.Tensor:
        """u_obj = phi(w_n^(basic) (+) w_n^(modif)) (sec. 3.2): ``(..., W) -> (..., d)``."""
        basic, modif = self._parts(ids)
        return self.phi(torch.cat([basic, modif], -1))

    def encode_attribute(self, noun: torch.Tensor, adjective: torch.Tensor) -> torch.Tensor:
        """u_attr = phi(w_n^(basic) (+) w_a^(modif)) (sec. 3.2): noun and adjective phrase
        ids ``(..., W)`` -> ``(..., d)``."""
        basic, _ = self._parts(noun)
        _, modif = self._parts(adjective)
        return self.phi(torch.cat([basic, modif], -1))

    def _psi(self, seq: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """psi (sec. 3.2): GRU over ``seq (N, L, d)``, the L2-normalised state after
        ``lengths (N,)`` steps (a uni-directional GRU's state at step t only depends on the
        steps before, so the padded run gives the same state as a packed one)."""
        out, _ = self.psi(seq)  # (N, L, d)
        last = (lengths.clamp(1, seq.size(1)) - 1).to(out.device)
        return l2norm(out[torch.arange(out.size(0), device=out.device), last])

    def encode_relation(
        self, subject: torch.Tensor, predicate: torch.Tensor, obj: torch.Tensor
    ) -> torch.Tensor:
        """u_rel = psi(phi(w_s), phi(w_r), phi(w_o)) (sec. 3.2): subject / object noun
        phrase ids ``(..., Wn)``, predicate ids ``(..., Wp)`` (one phi per predicate word)
        -> ``(..., d)``."""
        lead = predicate.shape[:-1]
        wp = predicate.size(-1)
        subj = self.encode_object(subject).reshape(-1, 1, self.cfg.embed_size)  # (N, 1, d)
        objt = self.encode_object(obj).reshape(-1, 1, self.cfg.embed_size)  # (N, 1, d)
        pred_ids = predicate.reshape(-1, wp)  # (N, Wp)
        pred = self.phi(torch.cat([self.basic(pred_ids), self.modif(pred_ids)], -1))  # (N, Wp, d)
        k = (pred_ids != 0).sum(1)  # (N,) predicate words (left-aligned)
        body = torch.cat([subj, pred, torch.zeros_like(subj)], 1)  # (N, Wp + 2, d)
        steps = torch.arange(wp + 2, device=pred_ids.device)
        at_object = (steps[None, :] == (k + 1)[:, None]).unsqueeze(-1)  # (N, Wp + 2, 1)
        seq = torch.where(at_object, objt.to(body.dtype), body)
        return self._psi(seq, k + 2).reshape(*lead, -1)

    def encode_sentence(self, words: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """u_sent = psi(phi(w_1), .., phi(w_k)) (sec. 3.2): ``(B, L) -> (B, d)``."""
        vectors = self.phi(torch.cat([self.basic(words), self.modif(words)], -1))  # (B, L, d)
        return self._psi(vectors, lengths)

    def encode_components(self, batch: dict) -> dict[str, torch.Tensor]:
        """Every text-side embedding of sec. 3.2: ``sent (B, d)``, ``obj (B, O, d)``,
        ``attr (B, A, d)``, ``rel (B, Rn, d)``, ``comp (B, d)`` (Norm of the sum of the
        valid components; zero for a caption without any) and ``has_comp (B,)``."""
        objects, omask = batch["objects"], batch["object_mask"]  # (B, O, W), (B, O)
        amask, rmask = batch["attribute_mask"], batch["relation_mask"]
        u_obj = self.encode_object(objects)  # (B, O, d)
        u_attr = self.encode_attribute(
            _gather_phrases(objects, batch["attribute_objects"]), batch["attributes"]
        )  # (B, A, d)
        u_rel = self.encode_relation(
            _gather_phrases(objects, batch["relation_subjects"]),
            batch["relations"],
            _gather_phrases(objects, batch["relation_objects"]),
        )  # (B, Rn, d)
        total = sum(
            (u * m.unsqueeze(-1).to(u.dtype)).sum(1)
            for u, m in ((u_obj, omask), (u_attr, amask), (u_rel, rmask))
        )  # Phi = sum, (B, d)
        return {
            "sent": self.encode_sentence(batch["words"], batch["word_lengths"]),
            "obj": u_obj,
            "attr": u_attr,
            "rel": u_rel,
            "comp": l2norm(total),
            "has_comp": omask.any(1) | amask.any(1) | rmask.any(1),
        }

    def encode_regions(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Sec. 3.3: the image embedding v ``(B, d)`` (average pooling, normalised) and the
        normalised local region embeddings V ``(B, G, d)``."""
        regions = self.conv(batch["grid"])  # (B, G, d)
        return l2norm(regions.mean(1)), l2norm(regions)

    def encode_image(self, batch: dict) -> torch.Tensor:
        # the mean of the Linear regions is the Linear of the mean cell: skip the G regions
        return l2norm(self.conv(batch["grid"].mean(1)))  # (B, d)

    def encode_text(self, batch: dict) -> torch.Tensor:
        """u_cap = alpha u_sent + (1 - alpha) u_comp (sec. 3.2): ``(B, d)``."""
        u = self.encode_components(batch)
        return self.cfg.alpha * u["sent"] + (1.0 - self.cfg.alpha) * u["comp"]

    def similarity(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        return cosine_sim(img, txt)  # (n_img, n_txt), s = cosine

    # ---- negatives (sec. 3.4) -----------------------------------------------------------

    def sample_negatives(
        self, batch: dict, generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        """Contrastive examples of sec. 3.4 as phrase ids (draws from ``generator`` on the
        batch's device, or the global torch RNG):

        - ``objects (B, O, Wn)``: a noun not among the caption's objects (nor, fn. 2, its
          image's other captions' in the batch); ``object_valid (B, O)``.
        - ``attr_nouns``, ``attr_adjectives (B, A, W)``: the adjective (by one not modifying
          the same object) or the noun replaced, at random; ``attribute_valid``.
        - ``rel_subjects``, ``rel_predicates``, ``rel_objects (B, Rn, W)``: the subject, the
          predicate (by another) or the object replaced; ``relation_valid``."""
        objects, omask = batch["objects"], batch["object_mask"]
        attributes, amask = batch["attributes"], batch["attribute_mask"]
        relations = batch["relations"]
        nouns, adjectives, predicates = self.neg_nouns, self.neg_adjectives, self.neg_relations
        # (K,) real entries (an empty vocabulary is one all-zero row, never drawn)
        real_noun, real_adj, real_pred = ((v != 0).any(-1) for v in (nouns, adjectives, predicates))

        # nouns present in the caption (B, Kn), widened to its image's captions (fn. 2)
        present = (_phrase_equal(objects, nouns) & omask.unsqueeze(-1)).any(1)
        if "caption_image" in batch:
            image = batch["caption_image"].to(objects.device)
            same = (image[:, None] == image[None, :]).to(torch.float32)  # (B, B)
            present = (same @ present.to(torch.float32)) > 0
        noun_ok = ~present & real_noun  # (B, Kn)

        def draw_noun(n: int):  # one noun per component, (B, n)
            return _sample(noun_ok[:, None, :].expand(-1, n, -1), generator)

        out: dict[str, torch.Tensor] = {}
        index, valid = draw_noun(objects.size(1))
        out["objects"], out["object_valid"] = nouns[index], valid

        # (adjective, noun): swap the adjective or the noun
        pos_nouns = _gather_phrases(objects, batch["attribute_objects"])  # (B, A, Wo)
        same_object = (
            batch["attribute_objects"][:, :, None] == batch["attribute_objects"][:, None, :]
        ) & amask[:, None, :]  # (B, A, A)
        used = _phrase_equal(attributes, adjectives) & amask.unsqueeze(-1)  # (B, A, Ka)
        taken = (same_object.to(torch.float32) @ used.to(torch.float32)) > 0  # (B, A, Ka)
        adj_index, adj_valid = _sample(~taken & real_adj, generator)
        noun_index, noun_valid = draw_noun(attributes.size(1))
        swap, valid = _sample(torch.stack([adj_valid, noun_valid], -1), generator)
        wn = max(pos_nouns.size(-1), nouns.size(-1))
        wa = max(attributes.size(-1), adjectives.size(-1))
        out["attr_nouns"] = _swap(swap == 1, nouns[noun_index], pos_nouns, wn)
        out["attr_adjectives"] = _swap(swap == 0, adjectives[adj_index], attributes, wa)
        out["attribute_valid"] = valid

        # (subject, predicate, object): swap one of the three
        subjects = _gather_phrases(objects, batch["relation_subjects"])  # (B, Rn, Wo)
        rel_objects = _gather_phrases(objects, batch["relation_objects"])
        pred_index, pred_valid = _sample(
            ~_phrase_equal(relations, predicates) & real_pred, generator
        )
        noun_index, noun_valid = draw_noun(relations.size(1))
        swap, valid = _sample(torch.stack([noun_valid, pred_valid, noun_valid], -1), generator)
        wp = max(relations.size(-1), predicates.size(-1))
        new_noun = nouns[noun_index]
        out["rel_subjects"] = _swap(swap == 0, new_noun, subjects, wn)
        out["rel_predicates"] = _swap(swap == 1, predicates[pred_index], relations, wp)
        out["rel_objects"] = _swap(swap == 2, new_noun, rel_objects, wn)
        out["relation_valid"] = valid
        return out

    # ---- loss (eq. 1-4, sec. 3.5) -------------------------------------------------------

    def etas(self, epoch: int) -> dict[str, float]:
        """Eq. 4 weights, sec. 3.5: ``eta_c = eta_o = eta_a = 0.5``; ``eta_r = 0`` in the
        first ``rel_start_epoch`` (2) epochs, then 1.0 ("we turn up eta_r to 1.0")."""
        c = self.cfg
        rel = c.eta_rel if epoch >= c.rel_start_epoch else c.eta_rel_start
        return {"comp": c.eta_comp, "obj": c.eta_obj, "attr": c.eta_attr, "rel": rel}

    def loss(self, batch: dict, negatives: dict | None = None) -> dict:
        """Eq. 4: ``l = l_sent + eta_c l_comp + eta_o l_obj + eta_a l_attr + eta_r l_rel``
        with the etas of ``batch["epoch"]`` (0 if absent). ``negatives`` (from
        ``sample_negatives``) are drawn here when not given."""
        m = self.cfg.margin
        v, regions = self.encode_regions(batch)  # (B, d), (B, G, d)
        u = self.encode_components(batch)
        neg = self.sample_negatives(batch) if negatives is None else negatives
        terms = {
            "sent": ranking_loss(v, u["sent"], m),  # eq. 1
            "comp": ranking_loss(v, u["comp"], m, u["has_comp"]),  # eq. 1
        }
        obj_valid = batch["object_mask"] & neg["object_valid"]  # (B, O)
        per_obj = region_alignment(regions, u["obj"], self.encode_object(neg["objects"]), m)
        terms["obj"] = torch.where(obj_valid, per_obj, torch.zeros_like(per_obj)).sum()
        attr_valid = batch["attribute_mask"] & neg["attribute_valid"]  # (B, A)
        u_attr_neg = self.encode_attribute(neg["attr_nouns"], neg["attr_adjectives"])
        per_attr = region_alignment(regions, u["attr"], u_attr_neg, m)  # eq. 2-3
        terms["attr"] = torch.where(attr_valid, per_attr, torch.zeros_like(per_attr)).sum()
        u_rel_neg = self.encode_relation(
            neg["rel_subjects"], neg["rel_predicates"], neg["rel_objects"]
        )
        terms["rel"] = relation_loss(
            v, u["rel"], u_rel_neg, batch["relation_mask"], neg["relation_valid"], m
        )
        etas = self.etas(int(batch.get("epoch", 0)))
        total = terms["sent"] + sum(etas[k] * terms[k] for k in etas)
        return {"loss": total, **terms}
