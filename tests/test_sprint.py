"""SPRINT fusion routes: construction, the fusion against SPRINT's formulation, path drop, bad values."""
import pytest
import torch

import dit
from dit import get_model
from routing_module import RouteError, resolve_routes, select_kept_tokens
from test_routing import inputs, route
from tread_utils.errors import UserError

SPRINT = dict(route(2, 3, 0.75), fusion="sprint")


def sprint_model(**options):
    torch.manual_seed(0)
    model = get_model("DiT-T/2", dict(num_classes=10, in_channels=1, input_size=16, enable_routing=True, depth=6,
                                      routes=[dict(SPRINT, fusion_options=options)], hidden_size=32, num_heads=2))
    for name, p in model.named_parameters():  # carry signal through every block (not adaLN-Zero)
        if "fusions" not in name:
            torch.nn.init.normal_(p, std=0.05)
    return model


def test_construction_and_their_initialisation():
    model = sprint_model()
    fusion = model.fusions["0"]
    assert not fusion.mask_token.requires_grad and fusion.mask_token.abs().max() > 0
    assert fusion.proj.in_features == 64 and fusion.proj.out_features == 32 and not fusion.proj.bias.any()
    assert fusion.proj.weight.abs().max() <= (6 / (64 + 32)) ** 0.5  # xavier-uniform bound
    trained = sprint_model(mask_token_trainable=True, mask_token_init="zeros", fusion_init="deep").fusions["0"]
    assert trained.mask_token.requires_grad and not trained.mask_token.any()
    assert torch.equal(trained.proj.weight, torch.cat([torch.eye(32), torch.zeros(32, 32)], 1))


def test_state_dict_of_tread_models_is_unchanged():
    """Old checkpoints keep loading: a model without sprint routes has no fusion keys."""
    def keys(routes):
        return set(get_model("DiT-T/2", dict(num_classes=10, in_channels=1, input_size=16, enable_routing=True,
                                             routes=routes, depth=6, hidden_size=32, num_heads=2)).state_dict())

    assert keys([route(2, 3)]) == keys([])
    assert keys([SPRINT]) - keys([]) == {"fusions.0.mask_token", "fusions.0.proj.weight", "fusions.0.proj.bias"}


def reference(model, x, t, y, seed=None, drop_all=False):
    """SPRINT's formulation written out: encoder, kept tokens through the middle, restore with mask tokens by
    ids_restore (kept then removed, un-shuffled by argsort), concatenation with the encoder output, projection,
    decoder. `seed`: the router's token choice; None: no token dropped."""
    fusion = model.fusions["0"]
    h = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder(y)
    for block in model.blocks[:2]:
        h = block(h, c)
    x_clone = h.clone()
    B, N, D = h.shape
    if seed is None:
        ids_keep = torch.arange(N).expand(B, N)
    else:
        ids_keep = select_kept_tokens(h, 0.75, torch.Generator().manual_seed(seed))
    removed = torch.ones(B, N, dtype=torch.bool).scatter(1, ids_keep, False)
    ids_remove = torch.stack([row.nonzero().flatten() for row in removed])
    ids_restore = torch.argsort(torch.cat([ids_keep, ids_remove], 1), dim=1)
    deep = torch.gather(h, 1, ids_keep.unsqueeze(-1).repeat(1, 1, D))
    for block in model.blocks[2:4]:
        deep = block(deep, c)
    deep = torch.cat([deep, fusion.mask_token.repeat(B, N - deep.shape[1], 1)], 1)
    deep = torch.gather(deep, 1, ids_restore.unsqueeze(-1).repeat(1, 1, D))
    if drop_all:
        deep = fusion.mask_token.expand(B, N, D)
    h = fusion.proj(torch.cat([deep, x_clone], -1))
    for block in model.blocks[4:]:
        h = block(h, c)
    return model.unpatchify(model.final_layer(h, c))


def test_fusion_matches_their_formulation():
    model = sprint_model(path_drop_prob=0.0)
    x, t, y = inputs()
    with torch.no_grad():
        routed = model.train()(x, t, y, routing_seed=3)
        torch.testing.assert_close(routed, reference(model, x, t, y, seed=3), rtol=1e-5, atol=1e-6)
        dense = model.eval()(x, t, y)  # inference: no token dropped, the fusion still applies
        torch.testing.assert_close(dense, reference(model, x, t, y), rtol=1e-5, atol=1e-6)


def test_path_drop_in_training_gives_only_mask_tokens_from_the_deep_path():
    model = sprint_model(path_drop_prob=0.5).train()
    fusion, seen = model.fusions["0"], []
    fusion.proj.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    torch.manual_seed(1)
    model(*inputs(batch=8))
    deep = seen[0][..., :32]  # the restored deep half of the projection's input
    dropped = (deep == fusion.mask_token).all(-1).all(-1)
    assert 0 < dropped.sum() < 8, "with p = 0.5 over 8 samples (seeded) some are dropped, some not"
    kept = deep[~dropped]
    assert ((kept == fusion.mask_token).all(-1).sum(1) == 48).all(), "others: mask tokens at the 48 dropped places"
    seen.clear()
    model.eval()(*inputs(batch=8))
    assert not (seen[0][..., :32] == fusion.mask_token).all(-1).any(), "no drop at inference"


def test_drop_deep_path_skips_the_deep_blocks():
    model = sprint_model().eval()
    calls = []
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda m, args, out, i=i: calls.append(i))
    x, t, y = inputs()
    with torch.no_grad():
        weak = model(x, t, y, drop_deep_path=True)
        assert calls == [0, 1, 4, 5]
        torch.testing.assert_close(weak, reference(model, x, t, y, drop_all=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("option, needle", [
    (dict(fusion="sprnt"), "fusion must be one of none, sprint"),
    (dict(fusion_options=dict(path_drop_prob=1.0)), r"path_drop_prob must be in \[0, 1\), got 1.0"),
    (dict(fusion_options=dict(mask_token_init="uniform")), "mask_token_init must be one of normal, zeros"),
    (dict(fusion_options=dict(fusion_init="zero")), "fusion_init must be one of xavier, deep"),
    (dict(fusion_options=dict(mask_token_trainable="yes")), "mask_token_trainable must be bool"),
    (dict(path_drop_prob=0.2), r"a fusion's own setting goes in its fusion_options: "
                               r"\+model.params.routes.N.fusion_options.path_drop_prob=")])
def test_bad_fusion_value_is_one_clear_line(option, needle):
    with pytest.raises(RouteError, match=needle):
        resolve_routes([dict(SPRINT, **option)], 6, dit.FUSIONS)  # the model's registry names the fusions
    assert issubclass(RouteError, UserError)


def test_a_run_saved_with_the_settings_beside_the_route_still_loads():
    """Runs saved before sprint's settings moved into fusion_options: a sprint route's move there, a plain route's
    defaults are dropped; the command line's old keys stay refused (above)."""
    from routing_module import saved_routes

    old = [dict(route(1, 1), path_drop_prob=0.1, mask_token_trainable=False, mask_token_init="normal",
                fusion_init="xavier"),
           dict(SPRINT, path_drop_prob=0.3, mask_token_trainable=False, mask_token_init="zeros", fusion_init="deep")]
    routes = resolve_routes(saved_routes(old, dit.FUSIONS), 6, dit.FUSIONS)
    assert routes[0].fusion_options == {}
    assert routes[1].fusion_options == dict(path_drop_prob=0.3, mask_token_trainable=False, mask_token_init="zeros",
                                            fusion_init="deep")
    with pytest.raises(RouteError, match="unknown key"):  # a plain route with a setting it cannot have had
        resolve_routes(saved_routes([dict(route(1, 1), path_drop_prob=0.3)], dit.FUSIONS), 6, dit.FUSIONS)


def test_config_check_and_flop_count_know_sprint_routes():
    from hydra import compose, initialize_config_dir

    from conftest import REPO
    from training.config_check import check_train_config
    from training.flops import analytic_training_flops, training_step_flops

    def check(*overrides):
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            return check_train_config(compose("config", overrides=list(overrides))).config

    assert check("model.params.routes.0.fusion=sprint").model.params.routes[0].fusion == "sprint"
    from test_config_schema import compose_train

    with pytest.raises(UserError, match=r"unknown config key model.params.routes.0.path_drop_prob; .*"
                                        r"\+model.params.routes.0.fusion_options.path_drop_prob=\.\.\."):
        compose_train("model.params.routes.0.fusion=sprint", "model.params.routes.0.path_drop_prob=0.2")
    with pytest.raises(UserError, match="fusion must be one of none, sprint"):
        check("model.params.routes.0.fusion=sprnt")
    params = dict(num_classes=10, in_channels=4, input_size=32, enable_routing=True, routes=[SPRINT])
    measured, analytic = training_step_flops("DiT-S/2", params, 2), analytic_training_flops("DiT-S/2", params, 2)
    assert abs(measured - analytic) / measured < 0.01


def test_path_drop_guidance_weak_branch_is_the_model_with_its_path_dropped():
    from edm.guidance import PathDropGuidance
    from edm.precond import EDMPrecond
    from generation import build_guided_net

    model = sprint_model().eval()
    net = EDMPrecond(model)
    x, _, y = inputs()
    sigma = torch.tensor(2.0)
    with torch.no_grad():
        weak, full = net(x, sigma, y, drop_deep_path=True), net(x, sigma, y)
        guided = build_guided_net(net, {"path_drop_guidance": {"scale": 1.5}, "guidance_interval": [1, 3]})
        assert isinstance(guided, PathDropGuidance)
        torch.testing.assert_close(guided(x, sigma, y), weak + 1.5 * (full - weak))
        torch.testing.assert_close(guided(x, torch.tensor(5.0), y), net(x, torch.tensor(5.0), y))  # outside
        assert PathDropGuidance(net, 0.0)(x, sigma, y).equal(weak)
    with pytest.raises(UserError, match="path-drop guidance needs a route whose fusion can drop its deep path"):
        build_guided_net(EDMPrecond(get_model("DiT-T/2", dict(num_classes=10, in_channels=1, input_size=16,
                                                              enable_routing=False, depth=2))),
                         {"path_drop_guidance": {"scale": 1.5}})


def test_in_training_eval_scores_path_drop_guidance_and_refuses_it_without_sprint_routes(tmp_path):
    """`train.eval.path_drop_scales=[w]` adds fid_pdg<w> (and its grid) scored on the PDG-guided samples: the
    same seeds sampled through build_guided_net with that scale and the guidance interval give the same FID."""
    from accelerate import Accelerator
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from conftest import REPO, tiny_overrides
    from evaluations.features import compute_features
    from generation import build_guided_net, generate
    from training.config_check import check_train_config
    from training.checkpoint import build_denoiser
    from training.in_training_eval import TrainingEvaluator

    def cfg_of(*overrides):
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            return compose("config", overrides=[*tiny_overrides("tread"), "train.eval.eval_interval=20",
                                                "train.eval.fid_num_samples=128", *overrides])

    with pytest.raises(UserError, match=r"train.eval.path_drop_scales=\[1.5\] is not allowed.*fusion can drop"):
        check_train_config(cfg_of("train.eval.path_drop_scales=[1.5]"))
    with pytest.raises(UserError, match="guidance_interval"):
        check_train_config(cfg_of("train.eval.guidance_interval=[2,1]"))
    cfg = cfg_of("model.params.routes.0.fusion=sprint", "train.eval.path_drop_scales=[2]",
                 "train.eval.guidance_interval=[0.5,5]", "train.eval.sampler.num_steps=3")
    check_train_config(cfg)  # accepted (train.py then runs on the composed config, as here)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = get_model(cfg.model.backbone_type, OmegaConf.to_container(cfg.model.params, resolve=True))
    for p in model.parameters():  # carry signal through every block, so the deep path matters
        torch.nn.init.normal_(p, std=0.05)
    net = build_denoiser(cfg.diffuser, model).eval()
    evaluator = TrainingEvaluator(cfg, accelerator, tmp_path)
    metrics = evaluator(net, 20)
    assert {"fid", "fid_pdg2", "class_acc_pdg2", "nn_ratio_pdg2"} <= set(metrics)
    assert metrics["fid_pdg2"] != metrics["fid"]
    assert (tmp_path / "samples" / "step_00000020_pdg2.png").exists()
    assert evaluator.last_grid == tmp_path / "samples" / "step_00000020.png"
    guided = build_guided_net(net, {"path_drop_guidance": {"scale": 2.0}, "guidance_interval": [0.5, 5]})
    images, labels = generate(guided, evaluator.seeds, sampler_kwargs=evaluator.sampler_kwargs,
                              decoder=evaluator.decoder, batch_size=evaluator.batch_size, progress=False)
    feats = compute_features(evaluator.extractor, images, keys=("pool", "spatial", "logits"), stats_keys=("spatial",))
    assert evaluator.score(feats, images, labels)["fid"] == pytest.approx(metrics["fid_pdg2"], rel=1e-5)


def test_flop_report_counts_path_drop_guidance_against_cfg():
    from training.flops import architecture, block_forward_flops, format_report, guidance_flops, \
        routing_flop_report, sampling_forward_flops

    params = dict(num_classes=10, in_channels=4, input_size=32, enable_routing=True, routes=[SPRINT])
    full, weak = sampling_forward_flops("DiT-T/4", params), sampling_forward_flops("DiT-T/4", params, True)
    report = routing_flop_report("DiT-T/4", params, 1)
    assert report["cfg_step_flops"] == 2 * full and report["pdg_step_flops"] == full + weak
    a = architecture("DiT-T/4", params)
    n, width = a["num_tokens"], a["hidden_size"]  # the weak pass: blocks 2 and 3 skipped, the 2C -> C fusion run
    assert weak == pytest.approx(full - 2 * block_forward_flops(a, n) + 2 * n * 2 * width * width, rel=0.02)
    assert "path-drop" in format_report("DiT-T/4", report, 1)
    assert guidance_flops("DiT-T/4", dict(params, routes=[route(2, 3, 0.75)])) == {}  # no sprint route: no line


def test_guidance_eval_scores_cfg_and_pdg_at_equal_network_evaluations(tmp_path, capsys):
    """lab.guidance_eval on a 2-step sprint run: one row per setting, CFG and PDG with the same NFE and
    network passes, PDG with fewer FLOPs; a run without sprint routes is refused in one line."""
    import json

    from conftest import run_script, tiny_overrides
    from lab import guidance_eval

    from concurrent.futures import ThreadPoolExecutor

    def train(name, *extra):
        run_script("train.py", f"results_dir={tmp_path}", f"run_name={name}", *tiny_overrides("tread"), *extra,
                   "train.max_steps=2", "train.ckpt_every=2", "train.eval.sampler.num_steps=3", check=True)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda a: train(*a), [("sprint", "model.params.routes.0.fusion=sprint"), ("plain",)]))
    out = tmp_path / "guidance"
    guidance_eval.main([str(tmp_path / "sprint"), "--cfg-scales", "2", "--pdg-scales", "2", "--num-samples", "128",
                        "--guidance-interval", "0.1", "10", "--out", str(out)])
    rows = {r["setting"]: r for r in json.loads((out / "guidance.json").read_text())["rows"]}
    assert list(rows) == ["unguided", "cfg2", "pdg2"]
    assert rows["unguided"]["nfe"] == rows["cfg2"]["nfe"] == rows["pdg2"]["nfe"] == 5  # Heun, 3 steps: 2 x 3 - 1
    assert rows["cfg2"]["network_passes"] == rows["pdg2"]["network_passes"] == 2 * rows["unguided"]["network_passes"]
    assert rows["unguided"]["gflops_per_sample"] < rows["pdg2"]["gflops_per_sample"] < rows["cfg2"]["gflops_per_sample"]
    assert len({rows[s]["fid"] for s in rows}) == 3 and all(0 <= rows[s]["class_acc"] <= 1 for s in rows)
    assert "| pdg2 |" in (out / "guidance.md").read_text() and (out / "samples" / "step_00000000_pdg2.png").exists()
    with pytest.raises(SystemExit):
        guidance_eval.main([str(tmp_path / "plain"), "--out", str(tmp_path / "x")])
    assert "no route whose fusion can drop its deep path" in capsys.readouterr().err
