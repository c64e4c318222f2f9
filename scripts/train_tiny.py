"""Trains ninfer-tiny: a small `qwen3_5_moe` of the real architecture, with its MTP head.

The model is `Qwen3_5MoeForCausalLM` from transformers (Gated DeltaNet and gated attention layers
in the 3:1 pattern, routed top-k experts with a gated shared expert) plus our own MTP module
(`MtpHead`, model-spec.md §3.1; transformers has none), trained jointly on Python source code that
exists offline: the standard library of the running interpreter, and by default also the Python
files of its site-packages. Held out: a fixed subset of the standard library's files.

Writes into `--out` the Hugging Face layout the converter reads (model-spec.md §1.2): config.json,
generation_config.json, model.safetensors (bf16, with the `mtp.*` tensors), tokenizer.json (our
byte-level BPE holding the Qwen special tokens), chat_template.jinja, heldout.txt (held-out text
to score), quality.json (losses and transformers' perplexity on heldout.txt over the same
windows `ninfer.perplexity` uses).

Needs torch, transformers >= 5.17, tokenizers, safetensors, numpy; never imports ninfer.
  python scripts/train_tiny.py --out DIR --minutes 8.4   # GPU: as many steps as fit (2,072 on an H200)
  python scripts/train_tiny.py --out DIR --steps 20 --device cpu --extra-mb 0   # smoke test
  python scripts/train_tiny.py --eval DIR --device cpu    # add transformers' float32 perplexity
docs/quality.md describes the committed run (tests/fixtures/ninfer-tiny/).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import site
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from make_demo_model import stdlib_files, train_tokenizer  # noqa: E402

from transformers import GenerationConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (  # noqa: E402
    Qwen3_5MoeDecoderLayer,
    Qwen3_5MoeRMSNorm,
    Qwen3_5MoeTopKRouter,
)

TEMPLATE = ROOT / "python" / "ninfer" / "templates" / "qwen3_6.jinja"
PERIOD = ["linear_attention"] * 3 + ["full_attention"]
# The shape: every matrix input dim a multiple of 32 (q8_g32), hidden a multiple of 64 (q6_g64
# head), expert widths multiples of 16 (nvfp4). Sized for the limits below.
SHAPE = dict(
    hidden_size=192, num_hidden_layers=8, layer_types=PERIOD * 2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
)
VOCAB = 4096
BF16_LIMIT = 16_000_000
NVFP4_LIMIT = 6_000_000
HELDOUT_BUCKETS = 40  # one stdlib file in 40 (by a hash of its path) is held out
HELDOUT_TEXT_BYTES = 36_000  # size of heldout.txt, whole held-out files up to this many bytes
# ninfer's default perplexity windows (ninfer.perplexity: context 512, stride = context).
PPL_CONTEXT = 512
PPL_SHORT = 1536  # tokens of heldout.txt scored by the quick test (three windows)


def log(msg: str) -> None:
    print(msg, flush=True)


def make_config(vocab: int, eos: list[int]) -> Qwen3_5MoeTextConfig:
    # rope as in the real model (model-spec.md §1.1): theta 1e7, partial factor 0.25 (16 rotary
    # dims of 64), mrope_section summing to 8.
    return Qwen3_5MoeTextConfig(
        **SHAPE, vocab_size=vocab, rms_norm_eps=1e-6, max_position_embeddings=32768,
        tie_word_embeddings=False, eos_token_id=eos, pad_token_id=eos[-1], mtp_num_hidden_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [4, 2, 2], "mrope_interleaved": True},
    )


def estimated_sizes(cfg: Qwen3_5MoeTextConfig, resource_bytes: int) -> tuple[int, int]:
    """Bytes of the bf16 safetensors and of the `qwen3_6_35b_a3b_nvfp4` artifact, from the shapes
    and the encodings of docs/format.md §3 (plus alignment and the converter's header reserve)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    hq, hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    Kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    Vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    hv, E, I, Is = cfg.linear_num_value_heads, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    enc = {"nvfp4": lambda n, k: n * k // 2 + n * k // 16 + 8, "q8": lambda n, k: n * k + n * k // 16,
           "q6": lambda n, k: n * k * 3 // 4 + n * k // 32, "bf16": lambda n, k: 2 * n * k}
    tensors: list[tuple[str, int, int]] = []  # (encoding, rows, cols)

    def layer(full: bool) -> None:
        if full:
            tensors.extend([("q8", 2 * hq * D, H), ("q8", hkv * D, H), ("q8", hkv * D, H), ("q8", H, hq * D),
                            ("bf16", 1, D), ("bf16", 1, D)])
        else:
            tensors.extend([("q8", 2 * Kd + Vd, H), ("q8", Vd, H), ("q8", hv, H), ("q8", hv, H),
                            ("bf16", 2 * Kd + Vd, 4), ("bf16", 1, hv), ("bf16", 1, hv),
                            ("bf16", 1, cfg.linear_value_head_dim), ("q8", H, Vd)])
        tensors.extend([("bf16", 1, H), ("bf16", 1, H), ("bf16", E, H), ("nvfp4", E * 2 * I, H),
                        ("nvfp4", E * H, I), ("nvfp4", 2 * Is, H), ("nvfp4", H, Is), ("bf16", 1, H)])

    for kind in cfg.layer_types:
        layer(kind == "full_attention")
    layer(True)  # the MTP layer
    tensors.extend([("q8", V, H), ("bf16", 1, H), ("q6", V, H), ("bf16", 1, H), ("bf16", 1, H),
                    ("q8", H, 2 * H), ("bf16", 1, H)])
    bf16 = sum(2 * n * k for _, n, k in tensors)
    parts = sum(enc[e](n, k) + 256 * (3 if e == "nvfp4" else 2) for e, n, k in tensors)
    header = 65536 + 1024 * len(tensors)
    return bf16, header + parts + resource_bytes + 4096


# --- the MTP head (model-spec.md §3.1) -----------------------------------------------------------


class MtpHead(nn.Module):
    """u = fc([norm_emb(e) ‖ norm_hidden(h)]); one full-attention decoder layer with MoE; norm.
    `h` is the main model's final-normed hidden state at position t, `e` the embedding of token
    t+1, rotary position t; the shared lm_head turns the output into logits for token t+2.
    Parameter names are the checkpoint's `mtp.*` names (model-spec.md §1.2)."""

    def __init__(self, cfg: Qwen3_5MoeTextConfig):
        super().__init__()
        H = cfg.hidden_size
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(H, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(H, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        # transformers' decoder layer takes its block type from layer_types[layer_idx]: give it the
        # index of a full-attention layer.
        full = cfg.layer_types.index("full_attention")
        self.layers = nn.ModuleList([Qwen3_5MoeDecoderLayer(cfg, full)])
        self.norm = Qwen3_5MoeRMSNorm(H, eps=cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, e: torch.Tensor, pos_emb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(h)], dim=-1))
        for layer in self.layers:
            # No mask: SDPA then runs causally (the model is built with attn_implementation="sdpa").
            u = layer(u, position_embeddings=pos_emb, attention_mask=None)
        return self.norm(u)


def init_mtp(mtp: MtpHead, std: float) -> None:
    """transformers' initialisation for the parts of a decoder layer (zero-centred norms at 0,
    matrices and router N(0, std))."""
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if name.endswith("norm.weight") or "norm_" in name:
                p.zero_()
            else:
                p.normal_(0.0, std)


def forward_all(model: Qwen3_5MoeForCausalLM, mtp: MtpHead | None, x: torch.Tensor, nxt: torch.Tensor | None):
    """Main logits for inputs `x` [B, T] and, when `nxt` (tokens t+1) is given, MTP logits."""
    out = model.model(input_ids=x, use_cache=False)
    h = out.last_hidden_state
    logits = model.lm_head(h)
    if mtp is None or nxt is None:
        return logits, None
    B, T = x.shape
    pos = torch.arange(T, device=x.device).view(1, 1, T).expand(3, B, T)
    pos_emb = model.model.rotary_emb(h, pos)
    y = mtp(h, model.model.embed_tokens(nxt), pos_emb)
    return logits, model.lm_head(y)


# --- corpus --------------------------------------------------------------------------------------


def read_text(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def stdlib_split() -> tuple[list[str], list[str]]:
    files = stdlib_files(1 << 40)
    root = Path(sysconfig.get_paths()["stdlib"])
    held = [f for f in files if zlib.crc32(str(Path(f).relative_to(root)).encode()) % HELDOUT_BUCKETS == 0]
    held_set = set(held)
    return [f for f in files if f not in held_set], held


def fingerprints(text: str) -> tuple[str, str]:
    """Digests of the whole text and of its first 2,000 characters (a copy with a changed tail)."""
    return hashlib.sha1(text.encode()).hexdigest(), hashlib.sha1(text[:2000].encode()).hexdigest()


def site_files(limit_bytes: int, seed: int, exclude: set[str]) -> list[tuple[str, str]]:
    """Python files of site-packages (tests left out, and duplicates and copies of standard-library
    files: `exclude` holds their fingerprints), shuffled with `seed`, up to `limit_bytes`."""
    roots = sorted({str(Path(p).resolve()) for p in site.getsitepackages() + [site.getusersitepackages()] if Path(p).is_dir()})
    def fits(p: Path) -> bool:
        try:
            return p.is_file() and 200 <= p.stat().st_size <= 200_000
        except OSError:
            return False

    paths = sorted({str(p) for r in roots for p in Path(r).rglob("*.py") if not {"test", "tests"} & set(p.parts) and fits(p)})
    random.Random(seed).shuffle(paths)
    out, total, seen = [], 0, set(exclude)
    for p in paths:
        if total >= limit_bytes:
            break
        text = read_text(p)
        if text is None:
            continue
        prints = fingerprints(text)
        if seen.intersection(prints):
            continue
        seen.update(prints)
        out.append((p, text))
        total += len(text.encode())
    return out


def encode_docs(tok, texts: list[str], eot: int, budget_s: float = math.inf) -> tuple[np.ndarray, int]:
    """Token ids of the documents, each followed by <|endoftext|>, and how many documents were
    encoded: encoding stops after `budget_s` seconds (the documents come shuffled)."""
    chunks, t0, done = [], time.perf_counter(), 0
    for i in range(0, len(texts), 512):
        if time.perf_counter() - t0 > budget_s:
            break
        for enc in tok.encode_batch_fast(texts[i : i + 512]):
            chunks.append(np.asarray(enc.ids, dtype=np.int32))
            chunks.append(np.asarray([eot], dtype=np.int32))
        done = min(len(texts), i + 512)
    return np.concatenate(chunks), done


def heldout_text(held: list[tuple[str, str]]) -> str:
    """Whole held-out files of moderate size, in path order, up to HELDOUT_TEXT_BYTES."""
    out, total = [], 0
    for _, text in held:
        n = len(text.encode())
        if 2_000 <= n <= 12_000 and total + n <= HELDOUT_TEXT_BYTES:
            out.append(text)
            total += n
    return "".join(out)


# --- evaluation ----------------------------------------------------------------------------------


@torch.no_grad()
def windowed_ppl(model: Qwen3_5MoeForCausalLM, ids: list[int], context: int, device: str) -> dict:
    """Perplexity over the windows of ninfer.perplexity (stride = context): each window is scored
    from a fresh sequence, position j predicting token j+1, the window's first token unscored."""
    nll, scored = 0.0, 0
    for begin in range(0, len(ids) - 1, context):
        window = ids[begin : begin + context]
        if len(window) < 2:
            break
        logits = model(torch.tensor([window], device=device), use_cache=False).logits[0].double()
        lp = torch.log_softmax(logits[:-1], dim=-1)
        nll -= float(lp[torch.arange(len(window) - 1), torch.tensor(window[1:], device=device)].sum())
        scored += len(window) - 1
        if begin + context >= len(ids):
            break
    return {"perplexity": math.exp(nll / scored), "nll": nll / scored, "tokens_scored": scored, "tokens_total": len(ids)}


@torch.no_grad()
def heldout_losses(model, mtp, data: torch.Tensor, T: int, n: int, amp) -> dict:
    """Main and MTP loss on the first `n` non-overlapping windows of the held-out ids, the MTP's
    accuracy on token t+2 and how often its argmax equals the main model's argmax there (teacher
    forced: a proxy for greedy draft acceptance, model-spec.md §3.3)."""
    model.eval(), mtp.eval()
    rows = min(n, (len(data) - 2) // (T + 2))
    seqs = data[: rows * (T + 2)].view(rows, T + 2).long()
    sums = {"loss": 0.0, "mtp_loss": 0.0, "mtp_acc": 0.0, "mtp_agree": 0.0}
    for i in range(0, rows, 16):
        s = seqs[i : i + 16]
        with amp():
            logits, mlog = forward_all(model, mtp, s[:, :T], s[:, 1 : T + 1])
        k = len(s) / rows
        sums["loss"] += k * float(F.cross_entropy(logits.float().flatten(0, 1), s[:, 1 : T + 1].flatten()))
        sums["mtp_loss"] += k * float(F.cross_entropy(mlog.float().flatten(0, 1), s[:, 2:].flatten()))
        sums["mtp_acc"] += k * float((mlog.argmax(-1) == s[:, 2:]).float().mean())
        sums["mtp_agree"] += k * float((mlog[:, :-1].argmax(-1) == logits[:, 1:].argmax(-1)).float().mean())
    model.train(), mtp.train()
    return sums


# --- training ------------------------------------------------------------------------------------


def balance_loss(router_logits: list[torch.Tensor], k: int) -> torch.Tensor:
    """Switch-style load balancing, per MoE layer then averaged: E · Σ_e f_e · P_e."""
    total = 0.0
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        E = probs.shape[-1]
        top = torch.topk(probs, k, dim=-1).indices
        frac = torch.bincount(top.flatten(), minlength=E).float() / top.numel()
        total = total + E * (frac * probs.mean(0)).sum()
    return total / len(router_logits)


def grouped_bf16_experts(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Routed experts through torch's grouped GEMM in bf16 (the master weights stay float32);
    training speed only: the same math as transformers' experts (model-spec.md §2.5)."""
    k = top_k_index.shape[-1]
    order = torch.argsort(top_k_index.flatten(), stable=True)
    counts = torch.bincount(top_k_index.flatten(), minlength=self.num_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = hidden[order // k].to(torch.bfloat16)
    gu = F.grouped_mm(xs, self.gate_up_proj.to(torch.bfloat16).transpose(1, 2), offs=offs)
    g, u = gu.chunk(2, dim=-1)
    y = F.grouped_mm(F.silu(g) * u, self.down_proj.to(torch.bfloat16).transpose(1, 2), offs=offs)
    y = y * top_k_weights.flatten()[order].unsqueeze(-1).to(y.dtype)
    out = torch.zeros(hidden.shape[0] * k, hidden.shape[1], dtype=y.dtype, device=y.device)
    out[order] = y
    return out.view(hidden.shape[0], k, -1).sum(1).to(hidden.dtype)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def pick_experts_impl(model, step_fn, probe: torch.Tensor, device: str) -> str:
    """The fastest experts implementation that runs forward and backward here and gives eager's
    loss on the batch `probe`: our bf16 grouped GEMM, transformers' grouped_mm, or eager."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register("ninfer_grouped_bf16", grouped_bf16_experts)
    names = ["eager", "ninfer_grouped_bf16", "grouped_mm"]
    timings, ref = {}, None
    for name in names:
        model.config._experts_implementation = name
        try:
            loss = step_fn(True, probe)
            sync(device)
            t = time.perf_counter()
            for _ in range(3):
                step_fn(True, probe)
            sync(device)
            dt = (time.perf_counter() - t) / 3
        except Exception as e:  # an implementation this torch build lacks: try the next
            log(f"experts {name}: unavailable ({type(e).__name__}: {str(e)[:120]})")
            continue
        ref = loss if ref is None else ref
        ok = abs(loss - ref) < 0.05
        log(f"experts {name}: {dt * 1e3:.0f} ms/step, loss {loss:.4f}{'' if ok else ' (differs from eager: not used)'}")
        if ok:
            timings[name] = dt
    best = min(timings, key=timings.get)
    model.config._experts_implementation = best
    return best


def train(args, cfg, train_ids: np.ndarray, held_ids: np.ndarray, device: str, deadline: float) -> tuple:
    torch.manual_seed(args.seed)
    model = Qwen3_5MoeForCausalLM._from_config(cfg, attn_implementation="sdpa").to(device)
    # The MTP layer shares the model's config object, so it follows its attention and experts
    # implementation choices.
    mtp = MtpHead(model.config).to(device)
    init_mtp(mtp, cfg.initializer_range)
    model.train(), mtp.train()
    routers: list[torch.Tensor] = []
    for m in list(model.modules()) + list(mtp.modules()):
        if isinstance(m, Qwen3_5MoeTopKRouter):
            m.register_forward_hook(lambda _m, _i, out: routers.append(out[0]) if torch.is_grad_enabled() else None)

    params = list(model.parameters()) + list(mtp.parameters())
    decay = [p for p in params if p.ndim >= 2 and p.shape[-1] != cfg.linear_conv_kernel_dim]
    no_decay = [p for p in params if not any(p is q for q in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device == "cuda")
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device == "cuda" else (lambda: torch.autocast("cpu", enabled=False))
    T, B = args.seq, args.batch
    data = torch.from_numpy(train_ids).to(device)
    held = torch.from_numpy(held_ids).to(device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    offsets = torch.arange(T + 2, device=device)

    def batch() -> torch.Tensor:
        starts = torch.randint(0, len(data) - T - 2, (B,), device=device, generator=gen)
        return data[starts[:, None] + offsets].long()

    def step_fn(backward: bool, s: torch.Tensor | None = None) -> float:
        """One forward (and backward) pass; the main loss, or NaN when any gradient is not finite."""
        s = batch() if s is None else s
        routers.clear()
        with amp():
            logits, mlog = forward_all(model, mtp, s[:, :T], s[:, 1 : T + 1])
            main = F.cross_entropy(logits.float().flatten(0, 1), s[:, 1 : T + 1].flatten())
            aux = F.cross_entropy(mlog.float().flatten(0, 1), s[:, 2:].flatten())
            loss = main + args.mtp_weight * aux + args.balance * balance_loss(routers, cfg.num_experts_per_tok)
        if backward:
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if not math.isfinite(float(torch.nn.utils.clip_grad_norm_(params, 1.0))):
                return math.nan
        return float(main.detach())

    impl = pick_experts_impl(model, step_fn, batch(), device)
    # pick_experts_impl ran backward passes without optimizer steps: start from clean gradients.
    opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    ev = heldout_losses(model, mtp, held, T, args.eval_windows, amp)
    eval_s = time.perf_counter() - t0
    log(f"step 0: held-out loss {ev['loss']:.3f}  (experts {impl}, one evaluation {eval_s:.1f} s)")

    def take_snapshot(at: int) -> tuple:
        copy = lambda sd: {k: v.detach().clone() if torch.is_tensor(v) else copy(v) if isinstance(v, dict) else v for k, v in sd.items()}  # noqa: E731
        return copy(model.state_dict()), copy(mtp.state_dict()), copy(opt.state_dict()), at

    total, step, history, smooth, lr_scale = args.steps, 0, [], None, 1.0
    snapshot = take_snapshot(0)
    calib_from, calib_t = 10, 0.0
    start = time.perf_counter()
    while total is None or step < total:
        if total is None and step == calib_from:
            calib_t = time.perf_counter()
        # Time steps 10..40 (or as many as run in 20 s), then fix the step count for the budget.
        if total is None and step > calib_from and (step == calib_from + 30 or time.perf_counter() - calib_t > 20):
            per_step = (time.perf_counter() - calib_t) / (step - calib_from)
            left = deadline - time.perf_counter()
            # Reserve time for the evaluations still to come (one per ~10 % of the run) and the end.
            total = step + max(1, int((left - 11 * eval_s - 30) / per_step))
            log(f"{per_step * 1e3:.0f} ms/step: training for {total} steps in all (rerun with --steps {total})")
        lr = schedule(step, total, args) * lr_scale
        for g in opt.param_groups:
            g["lr"] = lr
        main = step_fn(backward=True)
        if not math.isfinite(main):
            # A diverged step: go back to the last evaluated state and halve the learning rate.
            model.load_state_dict(snapshot[0]), mtp.load_state_dict(snapshot[1]), opt.load_state_dict(snapshot[2])
            step, lr_scale = snapshot[3], lr_scale / 2
            log(f"non-finite loss or gradient: back to step {step}, learning rate x{lr_scale}")
            if lr_scale < 1e-2:
                log("diverged again and again: training stops at that step")
                break
            continue
        opt.step()
        step += 1
        smooth = main if smooth is None else 0.98 * smooth + 0.02 * main
        if step % 50 == 0:
            el = time.perf_counter() - start
            log(f"step {step}: train loss {smooth:.3f}  lr {lr:.2e}  {step * B * T / el / 1e3:.0f}k tok/s  {el:.0f} s")
        if total is not None and (step % max(1, total // 10) == 0 or step == total):
            ev = heldout_losses(model, mtp, held, T, args.eval_windows, amp)
            history.append({"step": step, "train_loss": smooth, **ev})
            if math.isfinite(ev["loss"]) and math.isfinite(ev["mtp_loss"]):
                snapshot = take_snapshot(step)
            log(f"step {step}: held-out loss {ev['loss']:.3f} (ppl {math.exp(ev['loss']):.2f})  MTP loss "
                f"{ev['mtp_loss']:.3f}  MTP acc {ev['mtp_acc']:.3f}  MTP agrees with main {ev['mtp_agree']:.3f}")
    info = {"steps": step, "tokens_seen": step * B * T, "seconds": time.perf_counter() - start,
            "experts_implementation": impl, "history": history}
    return model, mtp, info


def schedule(step: int, total: int | None, args) -> float:
    """Linear warmup, then cosine down to a tenth of the peak."""
    if step < args.warmup or total is None:
        return args.lr * min(1.0, (step + 1) / args.warmup)
    p = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


# --- output --------------------------------------------------------------------------------------


def save(out: Path, model, mtp, tok_json: str, eos: list[int]) -> None:
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    model.config._experts_implementation = "eager"
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos[-1], do_sample=True,
                                               temperature=0.7, top_p=0.95, top_k=20)
    model.to(device="cpu", dtype=torch.bfloat16).save_pretrained(out, safe_serialization=True)
    st = out / "model.safetensors"
    tensors = {k: v.contiguous() for k, v in load_file(st).items()}
    tensors.update({f"mtp.{k}": v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in mtp.state_dict().items()})
    save_file(tensors, st, metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(tok_json)
    (out / "chat_template.jinja").write_text(TEMPLATE.read_text())


def load_checkpoint(src: Path, dtype: torch.dtype, device: str) -> Qwen3_5MoeForCausalLM:
    model = Qwen3_5MoeForCausalLM.from_pretrained(src, dtype=dtype, attn_implementation="sdpa").to(device)
    model.set_experts_implementation("eager")
    return model.eval()


def record_ppl(src: Path, device: str, dtype: torch.dtype, key: str) -> dict:
    """transformers' perplexity of heldout.txt from the saved checkpoint, over the whole text and
    over its first PPL_SHORT tokens (the quick check of tests/test_quality.py), into quality.json."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    ids = tok.encode((src / "heldout.txt").read_text(), add_special_tokens=False).ids
    model = load_checkpoint(src, dtype, device)
    q = json.loads((src / "quality.json").read_text()) if (src / "quality.json").exists() else {}
    rec = q.setdefault("heldout_ppl", {"file": "heldout.txt", "context": PPL_CONTEXT, "stride": PPL_CONTEXT,
                                       "short_tokens": PPL_SHORT, "whole": {}, "short": {}})
    for part, part_ids in (("whole", ids), ("short", ids[:PPL_SHORT])):
        r = windowed_ppl(model, part_ids, PPL_CONTEXT, device)
        rec[part][key] = r
        log(f"transformers {key}, {part} heldout.txt: perplexity {r['perplexity']:.4f} over {r['tokens_scored']} tokens")
    (src / "quality.json").write_text(json.dumps(q, indent=1) + "\n")
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="output directory (the checkpoint)")
    ap.add_argument("--eval", type=Path, help="only record transformers' perplexity of this checkpoint")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--minutes", type=float, default=9.0, help="wall-clock budget of the whole run")
    ap.add_argument("--steps", type=int, help="optimizer steps (default: as many as fit in --minutes)")
    ap.add_argument("--extra-mb", type=float, default=150, help="MB of site-packages code added to the training text")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--balance", type=float, default=0.01, help="load-balancing loss coefficient")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.eval:
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        record_ppl(args.eval, args.device, dtype, f"transformers_{'bf16' if dtype == torch.bfloat16 else 'f32'}_{args.device}")
        return
    if not args.out:
        ap.error("--out or --eval is required")
    t_start = time.perf_counter()
    deadline = t_start + 60 * args.minutes
    random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.set_flush_denormal(True)  # CPU runs: denormal weights after updates slow every op down

    train_files, held_files = stdlib_split()
    train_docs = [(f, t) for f in train_files if (t := read_text(f)) is not None]
    held_docs = [(f, t) for f in held_files if (t := read_text(f)) is not None]
    tok_json = train_tokenizer(VOCAB, [f for f, _ in train_docs])
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    added = {t["content"]: t["id"] for t in json.loads(tok_json)["added_tokens"]}
    eos = [added["<|im_end|>"], added["<|endoftext|>"]]
    cfg = make_config(VOCAB, eos)
    resources = len(tok_json) + TEMPLATE.stat().st_size + 512
    bf16, nvfp4 = estimated_sizes(cfg, resources)
    log(f"estimated sizes: bf16 checkpoint {bf16 / 1e6:.2f} MB (limit {BF16_LIMIT / 1e6:.0f}), "
        f"nvfp4 artifact {nvfp4 / 1e6:.2f} MB (limit {NVFP4_LIMIT / 1e6:.0f})")
    if bf16 > BF16_LIMIT or nvfp4 > NVFP4_LIMIT:
        sys.exit("the shape does not fit the size limits")

    stdlib_prints = {d for _, t in train_docs + held_docs for d in fingerprints(t)}
    extra = site_files(int(args.extra_mb * 1e6), args.seed, stdlib_prints) if args.extra_mb > 0 else []
    eot = added["<|endoftext|>"]
    std_ids, _ = encode_docs(tok, [t for _, t in train_docs], eot)
    extra_ids, used = encode_docs(tok, [t for _, t in extra], eot, budget_s=60) if extra else (np.zeros(0, np.int32), 0)
    extra = extra[:used]
    train_ids = np.concatenate([std_ids, extra_ids])
    held_ids, _ = encode_docs(tok, [t for _, t in held_docs], eot)
    log(f"corpus: {len(train_docs)} stdlib + {len(extra)} site-packages files, {len(train_ids) / 1e6:.2f}M training "
        f"tokens; held out {len(held_docs)} stdlib files, {len(held_ids) / 1e3:.0f}k tokens "
        f"({time.perf_counter() - t_start:.0f} s so far)")

    model, mtp, info = None, None, {}
    try:
        model, mtp, info = train(args, cfg, train_ids, held_ids, args.device, deadline - 45)
    finally:
        if model is not None:
            save(args.out, model, mtp, tok_json, eos)
    (args.out / "heldout.txt").write_text(heldout_text(held_docs))
    n_params = sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in mtp.parameters())
    quality = {
        "params": n_params, "bf16_checkpoint_bytes": (args.out / "model.safetensors").stat().st_size,
        "estimated_nvfp4_artifact_bytes": nvfp4, "vocab_size": VOCAB,
        "corpus": {"python": sys.version.split()[0], "stdlib_train_files": len(train_docs),
                   "site_packages_files": len(extra), "heldout_files": len(held_docs),
                   "heldout_files_list": [str(Path(f).relative_to(sysconfig.get_paths()["stdlib"])) for f, _ in held_docs],
                   "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(held_ids))},
        "training": {k: v for k, v in vars(args).items() if k not in ("out", "eval")} | info,
    }
    (args.out / "quality.json").write_text(json.dumps(quality, indent=1) + "\n")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    record_ppl(args.out, args.device, dtype, f"transformers_{'bf16' if dtype == torch.bfloat16 else 'f32'}_{args.device}")
    log(f"wrote {args.out} in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
