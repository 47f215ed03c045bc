"""SimpleTuner's own transformer files beside `apply_tread`, fed the same kept tokens: outputs, input gradients and
which blocks each side routes, per family and route layout.

SimpleTuner's `simpletuner/helpers/models/<family>/transformer.py` are diffusers transformers with its TREAD router
called inside their forward. Each family is built here as a tiny random diffusers model; SimpleTuner's class is
built from the same config and loaded with the same state dict. Our side routes by `apply_tread(...,
kept_count="simpletuner")`; every kept-token choice it makes is recorded and replayed into SimpleTuner's router
(its `get_mask` answers with those indices, after its own count is read), so both run the same tokens and what
remains to differ is the routing itself: gathering, per-token inputs (RoPE rows), block numbering, rejoining.
SimpleTuner is imported from the directory the user gives, never copied (AGPL).
"""
import contextlib
import importlib
import importlib.util
import inspect
import sys
import types
from pathlib import Path

import torch

from backbones import diffusers_tread
from backbones.diffusers_tread import apply_tread

B = 2
# Modules SimpleTuner's transformer files import at the top but never call on the path run here (SDPA attention,
# no FlashAttention-3 processor); they are stubbed only when not installed, and a stub raises if it is ever used.
STUBS = {"einops": ("rearrange",)}  # flux/attention.py: its FlashAttention-3 processors rearrange heads


def _stub(module: str, names: tuple) -> None:
    def unused(*args, **kwargs):
        raise RuntimeError(f"{module} is stubbed by lab.simpletuner_models: install it to run this path")
    stub = types.ModuleType(module)
    for name in names:
        setattr(stub, name, unused)
    sys.modules[module] = stub


def import_simpletuner(code_dir, family_module: str):
    """SimpleTuner's `helpers/models/<family_module>/transformer.py`, imported from a checkout (DIR/simpletuner)
    or an installed package directory (DIR itself is `simpletuner`)."""
    code_dir = Path(code_dir).resolve()
    root = code_dir if (code_dir / "simpletuner").is_dir() else code_dir.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    for module, names in STUBS.items():
        if module not in sys.modules and importlib.util.find_spec(module) is None:
            _stub(module, names)
    return importlib.import_module(f"simpletuner.helpers.models.{family_module}.transformer")


def _flux_ids(h, w, text):
    ids = torch.zeros(h, w, 3)
    ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None]
    return ids.reshape(-1, 3), torch.zeros(text, 3)


def _flux_like(cls_name, **extra):
    def build():
        import diffusers
        model = getattr(diffusers, cls_name)(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2,
                                             attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                             axes_dims_rope=(2, 2, 4), **extra)
        img_ids, txt_ids = _flux_ids(4, 5, 6)
        inputs = dict(hidden_states=torch.randn(B, 20, 4), encoder_hidden_states=torch.randn(B, 6, 16),
                      timestep=torch.rand(B), img_ids=img_ids, txt_ids=txt_ids, return_dict=False)
        if "pooled_projection_dim" in extra:
            inputs["pooled_projections"] = torch.randn(B, 16)
        return model, inputs
    return build


def _image(cls_name, timestep, **config):
    def build():
        import diffusers
        model = getattr(diffusers, cls_name)(**config)
        inputs = dict(hidden_states=torch.randn(B, 4, 8, 8), encoder_hidden_states=torch.randn(B, 6, 16),
                      timestep=timestep(), return_dict=False)
        if "pooled_projection_dim" in config:
            inputs["pooled_projections"] = torch.randn(B, 16)
        return model, inputs
    return build


def _wan():
    from diffusers import WanTransformer3DModel
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=4,
                                  rope_max_seq_len=32)
    return model, dict(hidden_states=torch.randn(B, 4, 2, 8, 8), encoder_hidden_states=torch.randn(B, 6, 16),
                       timestep=torch.randint(0, 1000, (B,)), return_dict=False)


def _qwen():
    from diffusers import QwenImageTransformer2DModel
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=4,
                                        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                        axes_dims_rope=(2, 2, 4))
    return model, dict(hidden_states=torch.randn(B, 20, 16), encoder_hidden_states=torch.randn(B, 6, 16),
                       encoder_hidden_states_mask=torch.ones(B, 6), timestep=torch.rand(B),
                       img_shapes=[[(1, 4, 5)]] * B, return_dict=False)


def _ltx():
    from diffusers import LTXVideoTransformer3DModel
    model = LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12,
                                       cross_attention_dim=24, num_layers=4, caption_channels=16)
    return model, dict(hidden_states=torch.randn(B, 24, 4), encoder_hidden_states=torch.randn(B, 6, 16),
                       timestep=torch.randint(0, 1000, (B,)), encoder_attention_mask=torch.ones(B, 6), num_frames=2,
                       height=4, width=3, return_dict=False)


def _ernie():
    """Ernie, its zero-initialised modulation and output layer made random (a zero output would agree trivially)."""
    from diffusers import ErnieImageTransformer2DModel
    model = ErnieImageTransformer2DModel(hidden_size=16, num_attention_heads=2, num_layers=4, ffn_hidden_size=32,
                                         in_channels=4, out_channels=4, patch_size=2, text_in_dim=12,
                                         rope_axes_dim=(2, 2, 4))
    for p in (*model.adaLN_modulation.parameters(), *model.final_linear.parameters()):
        torch.nn.init.normal_(p, std=0.2)
    return model, dict(hidden_states=torch.randn(B, 4, 8, 10), timestep=torch.rand(B) * 1000,
                       text_bth=torch.randn(B, 6, 12), text_lens=torch.full((B,), 6), return_dict=False)


def _minimax():
    """MiniMax H3 on its text-to-video-and-audio layout [text | audio | video]: 6 text, 3 audio, 2 x 3 x 4 video
    rows."""
    from diffusers import MiniMaxH3Transformer3DModel

    from tools.diffusers_toy import minimax_inputs
    model = MiniMaxH3Transformer3DModel(num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=4,
                                        num_refiner_layers=1, ffn_dim=32, in_channels=4, audio_in_channels=4,
                                        patch_size=(1, 1, 1), text_dim=16, freq_dim=16, time_embed_hidden_dim=16,
                                        time_embed_dim=16, rope_freq_dim=2)
    inputs = minimax_inputs(torch.randn(B, 4, 2, 3, 4), torch.randn(B, 6, 16), torch.rand(B), audio=3, audio_channels=4)
    return model, dict(inputs, return_dict=False)


_SD3 = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
            pos_embed_max_size=16)
_PIXART = dict(sample_size=8, num_layers=4, patch_size=2, attention_head_dim=8, num_attention_heads=2, in_channels=4,
               out_channels=8, cross_attention_dim=16, caption_channels=16, norm_type="ada_norm_single",
               use_additional_conditions=False)
_AURAFLOW = dict(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=2, num_single_dit_layers=2,
                 attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                 out_channels=4, pos_embed_max_size=16)
_FLOAT_T, _INT_T = (lambda: torch.rand(B) * 1000), (lambda: torch.randint(0, 1000, (B,)))

# name: (SimpleTuner's models/<folder>, its class, our block lists in numbering order, tiny model and inputs)
FAMILIES = {
    "flux": ("flux", "FluxTransformer2DModel", ("transformer_blocks", "single_transformer_blocks"),
             _flux_like("FluxTransformer2DModel", pooled_projection_dim=16)),
    "sd3": ("sd3", "SD3Transformer2DModel", ("transformer_blocks",), _image("SD3Transformer2DModel", _FLOAT_T, **_SD3)),
    "pixart": ("pixart", "PixArtTransformer2DModel", ("transformer_blocks",),
               _image("PixArtTransformer2DModel", _INT_T, **_PIXART)),
    "auraflow": ("auraflow", "AuraFlowTransformer2DModel", ("joint_transformer_blocks", "single_transformer_blocks"),
                 _image("AuraFlowTransformer2DModel", _FLOAT_T, **_AURAFLOW)),
    "wan": ("wan", "WanTransformer3DModel", ("blocks",), _wan),
    "chroma": ("chroma", "ChromaTransformer2DModel", ("transformer_blocks", "single_transformer_blocks"),
               _flux_like("ChromaTransformer2DModel", approximator_num_channels=16, approximator_hidden_dim=32,
                          approximator_layers=1)),
    "qwen": ("qwen_image", "QwenImageTransformer2DModel", ("transformer_blocks",), _qwen),
    "ltx": ("ltxvideo", "LTXVideoTransformer3DModel", ("transformer_blocks",), _ltx),
    "ernie": ("ernie", "ErnieImageTransformer2DModel", ("layers",), _ernie),
    "minimax": ("minimaxh3", "MiniMaxH3Transformer3DModel", ("transformer_blocks",), _minimax),
}
# Families both route whose SimpleTuner file cannot be run against its own router, read from bc8e6ab.
NOT_COMPARED = {
    "flux2": "SimpleTuner's FLUX.2 transformer calls router.route()/unroute(), which its TREADRouter does not define "
             "(AttributeError on the first routed step); it also gathers one RoPE row set for the whole batch",
    "hunyuan": "SimpleTuner's HunyuanVideo transformer is HunyuanVideo 1.5 (another architecture than diffusers' "
               "HunyuanVideoTransformer3DModel) and its set_router refuses routes (NotImplementedError)",
}

# Why SimpleTuner's file fails where it does (read from bc8e6ab); ours follows the paper's rule there: kept tokens run
# the blocks with their own per-token inputs, skipped tokens rejoin unchanged.
WHY_IT_FAILS = {
    "flux": "with a force-keep mask, a route starting in a single-stream block slices force_keep_mask[:, txt_len:] "
            "as if the mask covered the text too; it holds the image tokens only",
    "wan": "with per-token timesteps (Wan 2.2), the route gathers the tokens but not their timestep embeddings",
    "chroma": "the route hands per-sample RoPE tables [B, K, D] to diffusers' FluxAttnProcessor, which takes one "
              "[S, D] table (SimpleTuner's FLUX has its own processor; Chroma uses diffusers')",
    "qwen": "the route gathers the image tokens but hands the blocks the full image RoPE table (all N rows)",
    "ltx": "the route calls get_mask(token count, ratio, force_keep_mask=...), which its TREADRouter does not take",
}


def build_pair(name: str, module, seed: int = 0):
    """(our diffusers model, SimpleTuner's model with the same weights, inputs, unused config keys)."""
    folder, cls_name, _, build = FAMILIES[name]
    torch.manual_seed(seed)
    ours, inputs = build()
    cls = getattr(module, cls_name)
    accepted = inspect.signature(cls.__init__).parameters
    config = {k: v for k, v in ours.config.items() if not k.startswith("_")}
    dropped = {k: v for k, v in config.items() if k not in accepted}
    theirs = cls(**{k: v for k, v in config.items() if k in accepted})
    result = theirs.load_state_dict(ours.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return ours.train(), theirs.train(), inputs, dropped


@contextlib.contextmanager
def recorded_selection():
    """Every kept-token choice apply_tread makes, in order (the list fills while the context is open)."""
    chosen, select = [], diffusers_tread.select_kept_tokens

    def record(*args, **kwargs):
        chosen.append(select(*args, **kwargs))
        return chosen[-1]
    diffusers_tread.select_kept_tokens = record
    try:
        yield chosen
    finally:
        diffusers_tread.select_kept_tokens = select


def replaying_router(module, chosen: list, counts: list):
    """SimpleTuner's TREADRouter whose get_mask keeps `chosen`'s indices in turn, after recording its own count
    (the rest of its router, start_route and end_route, runs as it is)."""
    router = module.TREADRouter(seed=0)
    own = router.get_mask

    def get_mask(x, mask_ratio=0.0, *args, force_keep=None, **kwargs):
        info = own(x, mask_ratio, *args, force_keep=force_keep, **kwargs)
        keep = chosen.pop(0).to(x.device)
        counts.append((info.ids_keep.shape[1], keep.shape[1]))
        kept = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device).scatter(1, keep, True)
        rest = torch.argsort(kept.int(), dim=1, stable=True)[:, :x.shape[1] - keep.shape[1]]
        shuffle = torch.cat([keep, rest], 1)
        return type(info)(~kept, keep, rest, shuffle, torch.argsort(shuffle, dim=1))
    router.get_mask = get_mask
    return router


def block_lengths(model, block_lists) -> tuple:
    """A hook per block recording the length of the hidden_states it is given (in numbering order)."""
    seen, hooks = {}, []
    blocks = [block for name in block_lists for block in getattr(model, name)]
    for i, block in enumerate(blocks):
        # SimpleTuner's SD3 runs a block's parts without calling the block: watch its first norm there
        watched = block.norm1 if type(block).__name__ == "JointTransformerBlock" else block

        def record(module, args, kwargs, i=i):
            seen[i] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[1]
        hooks.append(watched.register_forward_pre_hook(record, with_kwargs=True))
    return seen, hooks


def run(model, inputs: dict, weight_seed: int = 1):
    """Output and the input gradients of a fixed random projection of it (hidden_states, encoder_hidden_states)."""
    leaves = {k: inputs[k].clone().requires_grad_() for k in ("hidden_states", "encoder_hidden_states")}
    out = model(**{**inputs, **leaves})[0]
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(weight_seed))
    (out * weight).sum().backward()
    model.zero_grad(set_to_none=True)
    return out.detach(), {k: v.grad for k, v in leaves.items()}


def difference(a, b) -> tuple:
    """(output, gradient) max abs differences of two `run` results."""
    return (a[0] - b[0]).abs().max().item(), max((a[1][k] - b[1][k]).abs().max().item() for k in a[1])


def unrouted(name: str, model, inputs: dict) -> tuple:
    """The unrouted training-mode result and each block's hidden_states length."""
    seen, hooks = block_lengths(model, FAMILIES[name][2])
    try:
        return run(model, inputs), dict(seen)
    finally:
        for hook in hooks:
            hook.remove()


def compare_layout(name: str, ours, theirs, module, inputs: dict, routes: list, full: tuple, extra: dict = None) -> dict:
    """One route layout: each side's result, the kept counts, and which blocks each side shortened (against
    `full`, each side's unrouted block lengths)."""
    block_lists, extra = FAMILIES[name][2], extra or {}
    inputs = {**inputs, **extra.get("inputs", {})}
    counts, their_len = [], block_lengths(theirs, block_lists)
    ours_len = ({}, [])
    try:
        with recorded_selection() as chosen:
            handle = apply_tread(ours, {"routes": routes}, kept_count="simpletuner")
            ours_len = block_lengths(ours, block_lists)  # after the routing hooks: it sees what the blocks get
            try:
                torch.manual_seed(0)
                mine = run(ours, {**inputs, **({"tread_mask": extra["mask"]} if "mask" in extra else {})})
            finally:
                handle.remove()
        theirs.set_router(replaying_router(module, list(chosen), counts), routes)
        try:
            other = run(theirs, {**inputs, **({"force_keep_mask": extra["mask"]} if "mask" in extra else {})})
            error = None
        except Exception as err:  # SimpleTuner's own failure on this layout is a finding, not ours
            other, error = None, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
        finally:
            theirs.set_router(None, [])
    finally:
        for hook in ours_len[1] + their_len[1]:
            hook.remove()
    routed = lambda seen, lengths: [i for i in sorted(seen) if seen[i] < lengths[i]]  # noqa: E731
    return dict(ours=mine, theirs=other, error=error, counts=counts,
                blocks=(routed(ours_len[0], full[0]), routed(their_len[0], full[1]) if error is None else None))


def _route(start, end, ratio=0.5):
    return {"selection_ratio": ratio, "start_layer_idx": start, "end_layer_idx": end}


# Route layouts over four blocks (two lists of two for FLUX, Chroma and AuraFlow: blocks 0-1, then 2-3).
LAYOUTS = {
    "across lists 1..2": [_route(1, 2)],
    "first list 0..1": [_route(0, 1)],
    "second list 2..3": [_route(2, 3)],
    "negative -3..-2": [_route(-3, -2)],
    "to the last 1..-1": [_route(1, -1, 0.75)],
    "start == end 2..2": [_route(2, 2)],
    "two routes 0..0, 2..3": [_route(0, 0, 0.25), _route(2, 3)],
}


def force_keep_mask(inputs: dict, tokens: int, seed: int = 2) -> torch.Tensor:
    """A [B, N] token mask, a different set per sample (a quarter of the tokens)."""
    return torch.rand(B, tokens, generator=torch.Generator().manual_seed(seed)) < 0.25


def compare_family(name: str, code_dir, layouts: dict = LAYOUTS) -> dict:
    """Every layout (and, for FLUX, per-sample masks) for one family: max abs differences against the tolerance
    (ten times each quantity's unrouted difference, at least 1e-6), kept counts and routed blocks of both sides."""
    module = import_simpletuner(code_dir, FAMILIES[name][0])
    ours, theirs, inputs, dropped = build_pair(name, module)
    (base_ours, full_ours), (base_theirs, full_theirs) = unrouted(name, ours, inputs), unrouted(name, theirs, inputs)
    base = difference(base_ours, base_theirs)
    tolerance = tuple(max(10 * d, 1e-6) for d in base)
    cases = dict(layouts)
    if name == "wan":  # Wan 2.2's per-token timesteps, [B, N]
        tokens = inputs["hidden_states"][0, 0].numel() // 4  # patch (1, 2, 2)
        timestep = torch.randint(0, 1000, (B, tokens), generator=torch.Generator().manual_seed(3))
        cases["across lists 1..2, per-token timesteps"] = (layouts["across lists 1..2"], {"inputs": {"timestep": timestep}})
    if name == "flux":  # per-sample force-keep masks, starting in each block list
        tokens = inputs["hidden_states"].shape[1]
        mask = force_keep_mask(inputs, tokens)
        cases.update({f"{k}, per-sample mask": (v, {"mask": mask}) for k, v in layouts.items()
                      if k in ("first list 0..1", "across lists 1..2", "second list 2..3")})
    rows = []
    for label, case in cases.items():
        routes, extra = case if isinstance(case, tuple) else (case, None)
        result = compare_layout(name, ours, theirs, module, inputs, routes, (full_ours, full_theirs), extra)
        diff = None if result["error"] else difference(result["ours"], result["theirs"])
        rows.append(dict(layout=label, diff=diff, error=result["error"], counts=result["counts"],
                         blocks=result["blocks"],
                         same=result["error"] is None and diff[0] <= tolerance[0] and diff[1] <= tolerance[1]
                         and result["blocks"][0] == result["blocks"][1]
                         and all(a == b for a, b in result["counts"])))
    return dict(family=name, baseline=base, tolerance=tolerance, dropped=dropped, rows=rows,
                file=f"simpletuner/helpers/models/{FAMILIES[name][0]}/transformer.py")


# SimpleTuner's --tread_config strings (it reads one starting with `{` by ast.literal_eval and hands the routes to the
# transformer's set_router): whether we accept each, and which FLUX blocks their transformer routes with it.
CONFIGS = ('{"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]}',
           '{"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2.5, "end_layer_idx": 3}]}',
           '{"routes": [{"selection_ratio": False, "start_layer_idx": 1, "end_layer_idx": 2}]}',
           '{"routes": [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 0}, '
           '{"selection_ratio": 0.25, "start_layer_idx": -2, "end_layer_idx": -1}]}')


def compare_configs(code_dir) -> list:
    """Per config string: our routes_from_config's blocks (or its refusal) and the blocks SimpleTuner's FLUX routes."""
    import ast

    from backbones.diffusers_tread import routes_from_config
    from routing_module import RouteError

    module = import_simpletuner(code_dir, "flux")
    ours, theirs, inputs, _ = build_pair("flux", module)
    _, full = unrouted("flux", theirs, inputs)
    rows = []
    for text in CONFIGS:
        try:
            mine = [list(range(r.start_layer_idx, r.end_layer_idx + 1))
                    for r in routes_from_config(text, len(full)) if r.selection_ratio > 0]
            mine = sorted(set(i for blocks in mine for i in blocks))
        except RouteError as err:
            mine = f"refused: {err}"
        seen, hooks = block_lengths(theirs, FAMILIES["flux"][2])
        theirs.set_router(module.TREADRouter(seed=0), ast.literal_eval(text)["routes"])
        try:
            run(theirs, inputs)
        finally:
            theirs.set_router(None, [])
            for hook in hooks:
                hook.remove()
        rows.append(dict(config=text, ours=mine, theirs=[i for i in sorted(seen) if seen[i] < full[i]]))
    return rows
