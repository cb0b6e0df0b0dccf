"""`batchsweep audit` on plain loops that fooled it (tests/programs/plain.py): correct code it called wrong, a
mistake behind a frozen encoder it called exact, randomness in the forward, and short windows over several epochs
of a loop without a DataLoader. Each verdict is held against the trace, and names the script's line."""
import json

import pytest

from batchsweep.sweeps.audit.command import main
from tests.conftest import ROOT

PLAIN = ROOT / "tests" / "programs" / "plain.py"
SOURCE = PLAIN.read_text().splitlines()


def line_of(text: str) -> str:
    """plain.py:N of the first line that holds `text`."""
    return f"plain.py:{next(i for i, line in enumerate(SOURCE, 1) if text in line)}"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('plain')}/mlflow.db"


def audited(tmp_path, store, capsys, *args: str) -> tuple[int, str, dict]:
    path = tmp_path / "plain.toml"
    words = ", ".join(f'"{a}"' for a in args)
    path.write_text(f'''name = "plain"
[program]
command = ["{{python}}", "{PLAIN}", "--batch-size", "{{physical_batch}}", "--accum", "{{accum_steps}}",
           "--seed", "{{seed}}", {words}]
''')
    code = main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")])
    out = capsys.readouterr().out
    found = json.loads((tmp_path / "audit.json").read_text())
    assert "contradicted" not in found, out  # no verdict against what the trace recorded
    return code, out, found


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sequential", "chained", "two_schedulers", "lr_tensor", "two_phase"])
def test_correct_schedules_tensors_and_a_second_optimizer_are_exact(case, tmp_path, store, capsys):
    """A warmup then a cosine through SequentialLR, and a ChainedScheduler, construct and step their children (the
    tracer counted them as the script's steps: `schedule_per_micro_batch` on a correct loop); an LR held in a
    tensor was read after the scheduler had changed it (a false `lr_differs`); a second optimizer went unseen. The
    run is 2 epochs of 8 windows, so a stop after N steps must count the second optimizer's too, and the first
    optimizer must be let go once the script drops it (it exits 3 where the tracer kept it alive)."""
    code, out, found = audited(tmp_path, store, capsys, "--case", case)
    assert code == 0 and found["verdicts"] == ["exact"], out
    assert found["steps_accumulated"] == found["steps_true_batch"] == 16
    assert not found["notes"], out


@pytest.mark.slow
def test_a_buffer_that_is_no_weight_is_a_note_beside_exact(tmp_path, store, capsys):
    """A float buffer counting training forwards moves k times a window at (b, k) and once at (b*k, 1): that is no
    weight, so the weights agree (`exact`) and the buffer is named beside it (it read as `update_scaled`, ratio 1)."""
    code, out, found = audited(tmp_path, store, capsys, "--case", "counter")
    assert code == 0 and found["verdicts"] == ["exact"], out
    assert len(found["notes"]) == 1 and "(2.seen)" in found["notes"][0], out


@pytest.mark.slow
def test_spectral_norms_vectors_are_a_stateful_forward_not_a_mistake(tmp_path, store, capsys):
    """spectral_norm's power iteration runs at each training forward: 4 times a window at (b, k), once at (b*k, 1),
    and the forward reads its vectors, so the runs part whatever the loop does: `stateful_forward`, exit 2."""
    code, out, found = audited(tmp_path, store, capsys, "--case", "spectral")
    assert code == 2 and found["verdicts"] == ["stateful_forward"], out
    assert found["stateful_buffers"] == "0.weight_u, 0.weight_v"


@pytest.mark.slow
def test_a_frozen_encoder_called_first_is_not_taken_for_the_model(tmp_path, store, capsys):
    """head(encoder(x)) with the encoder frozen: the weights compared are the head's, which the optimizer trains, so
    the L2 penalty on it in every micro-batch's loss is named (it was `exact`: the encoder's weights never move)."""
    code, out, found = audited(tmp_path, store, capsys, "--case", "probe")
    assert code == 1 and found["verdicts"] == ["weight_penalty_per_micro_batch"], out
    assert "Seen at: backward() at " in out and line_of("loss.backward()") in out, out


@pytest.mark.slow
@pytest.mark.parametrize("drops, p, verdicts, code, noted", [(2, "0.1", ["random_forward"], 2, False),
                                                              (1, "0.1", ["exact"], 0, True),
                                                              (2, "0", ["exact"], 0, False)])
def test_dropout_is_seen_and_said_never_called_a_mistake(drops, p, verdicts, code, noted, tmp_path, store, capsys):
    """Two dropout layers draw their masks in another order at (b, k) than at (b*k, 1): the runs part, and the
    audit says why (`random_forward`, naming the layers) instead of `unexplained`. One layer draws them in the same
    order: `exact`, with a note that the forward was random. At p = 0 nothing is drawn: `exact`, no note."""
    c, out, found = audited(tmp_path, store, capsys, "--case", "dropout", "--drops", str(drops), "--dropout", p)
    assert c == code and found["verdicts"] == verdicts, out
    if verdicts == ["random_forward"]:
        assert found["random_modules"] == "2: Dropout(p=0.1), 3: Dropout(p=0.1)" and "Switch the randomness off for the audit" in out
    assert bool(found["notes"]) == noted and ("drew random numbers" in out) == (noted or code == 2), out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_window_dropped_each_epoch_and_a_mean_of_means_are_both_named(dtype, tmp_path, store, capsys):
    """Two epochs over indexed tensors, no {epochs}: each epoch's short window is backwarded and never stepped (the
    next window's zero_grad drops it), and each micro-batch's token mean is divided by k. It read as
    `zero_grad_per_micro_batch`, the one call the trace shows never happened in a window that steps; 14 steps
    against 16 is one short per epoch."""
    code, out, found = audited(tmp_path, store, capsys, "--case", "skip_tokens", "--dtype", dtype)
    assert code == 1 and found["verdicts"] == ["short_window_skipped", "mean_of_micro_batch_means"], out
    assert (found["steps_accumulated"], found["steps_true_batch"], found["skipped_windows"]) == (14, 16, 2)
    assert "zero_grad() at " in out and line_of("opt.zero_grad()") + " drops it" in out, out
    assert found["first_differing_update"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_short_window_mid_run_is_named_as_one(dtype, tmp_path, store, capsys):
    """200 samples: 6 windows of 32 and one of a single micro-batch, each micro-batch's mean over k. The runs part
    at update 7 of 14, the first epoch's short window, where the tracer saw 1 micro-batch of 4: a quarter of the
    true batch's update is a short window divided by k (it read as `update_scaled`)."""
    code, out, found = audited(tmp_path, store, capsys, "--case", "short_mean", "--n", "200", "--dtype", dtype)
    assert code == 1 and found["verdicts"] == ["short_window_divided_by_k"], out
    assert found["first_differing_update"] == 7 and found["update_ratio"] == pytest.approx(0.25, rel=1e-4)
    assert line_of("loss.backward()") in out


@pytest.mark.slow
def test_a_model_compiled_with_fullgraph_is_audited_and_one_compiled_in_place_is_one_line(tmp_path, store, capsys):
    """torch.compile(model, fullgraph=True) ran the tracer's hooks through Dynamo, which refused them: the
    script crashed. Its hooks now run outside the graph (the compiled module is called as any module), and the
    loop is `exact`. A module compiled in place runs its hooks inside its graph, where the tracer leaves them
    out: the audit cannot see the model, and says why in one line."""
    code, out, found = audited(tmp_path, store, capsys, "--case", "plain", "--compile", "function")
    assert code == 0 and found["verdicts"] == ["exact"], out
    path = tmp_path / "plain.toml"
    path.write_text(path.read_text().replace('"function"', '"module"'))
    assert main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "compiled in place (module.compile())" in err, err


@pytest.mark.slow
def test_noise_added_to_the_gradients_is_not_called_a_mistake(tmp_path, store, capsys):
    """Gaussian noise added to the gradients before each step draws as many numbers at (b, k) as at (b*k, 1), and
    the runs agree: `exact`. Draws between the last backward and the step are not watched (a loop that fetches its
    next batch there by torch.randint draws alike in both runs, and was taken for a random step that hid an
    undivided loss), so no note."""
    code, out, found = audited(tmp_path, store, capsys, "--case", "grad_noise")
    assert code == 0 and found["verdicts"] == ["exact"] and found["notes"] == [], out


@pytest.mark.slow
def test_a_command_that_saves_into_its_trial_dir_is_audited(tmp_path, store, capsys):
    """{trial_dir}, a trial's own folder, is each audit run's own too (it was a KeyError traceback)."""
    code, out, found = audited(tmp_path, store, capsys, "--case", "plain", "--epochs", "1", "--out", "{trial_dir}")
    assert code == 0 and found["verdicts"] == ["exact"], out


@pytest.mark.slow
def test_a_script_run_in_its_trial_dir_is_audited(tmp_path, store, capsys):
    """cwd = "{trial_dir}" (a trial's own folder to run in) is each audit run's own: the audit ran the script in a
    folder literally named {trial_dir}, and failed."""
    path = tmp_path / "in_trial_dir.toml"
    path.write_text(f'''name = "plain"
[program]
command = ["{{python}}", "{PLAIN}", "--batch-size", "{{physical_batch}}", "--accum", "{{accum_steps}}",
           "--seed", "{{seed}}", "--case", "plain", "--epochs", "1", "--out", "."]
cwd = "{{trial_dir}}"
''')
    code = main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads((tmp_path / "audit.json").read_text())["verdicts"] == ["exact"], out + err


@pytest.mark.slow
def test_dropout_in_a_second_model_the_loop_calls_apart_is_seen(tmp_path, store, capsys):
    """head(net(x)), the head a model of its own whose functional dropouts draw in another order at (b, k): the
    runs part, and the audit says why (it read `unexplained`, exit status 1: only the first model was watched)."""
    code, out, found = audited(tmp_path, store, capsys, "--case", "head_dropout")
    assert code == 2 and found["verdicts"] == ["random_forward"], out
    # (what drew is said: no module is random by kind, the draws are F.dropout's; it read "none by kind")
    assert "from torch's default generator (a functional draw in the forward, such as F.dropout or torch.rand: no " \
           "module random by kind)" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("rng, named", [("random", "Python's random"), ("numpy", "NumPy's global generator")])
def test_a_layerdrop_drawn_from_python_or_numpy_is_seen(rng, named, tmp_path, store, capsys):
    """Hidden layers skipped where random.uniform(0, 1) < 0.5 (np.random.uniform), as some transformers models
    write LayerDrop: each micro-batch's forward draws its own, k a window against one, so the runs part. Only
    torch's generator was watched, and this correct loop read as a mistake (exit status 1); now the generator is
    named and whether the loop is right cannot be told."""
    code, out, found = audited(tmp_path, store, capsys, "--case", "layerdrop", "--rng", rng)
    assert code == 2 and found["verdicts"] == ["random_forward"], out
    assert found["random_generators"] == rng and f"from {named} (a draw in the forward's own code" in out, out
    assert "no module random by kind" in out and "cannot be told" in out, out


@pytest.mark.slow
def test_an_augmentation_in_the_step_is_named_where_the_data_differ(tmp_path, store, capsys):
    """Each micro-batch's inputs scaled by a factor drawn for the batch in the step, before its forward: k draws a
    window at (b, k) against one, so the windows hold other inputs (data_differs). The advice named draws before
    training alone; it names the draws in the step and what to do with them."""
    code, out, found = audited(tmp_path, store, capsys, "--case", "augment")
    assert code == 2 and found["verdicts"] == ["data_differs"] and found["data_window"] == 1, out
    assert found["step_generators"] == "torch's default generator", out
    assert "The training step drew from torch's default generator between its forwards" in out, out
    assert "draw it per sample from a generator seeded by {seed}" in out, out
    assert "or switch it off for the audit" in out and "these runs do not tell" in out, out


@pytest.mark.slow
def test_a_dropout_layer_that_is_never_called_is_no_randomness(tmp_path, store, capsys):
    """A dropout module in training mode that the forward never calls draws nothing: no note that the forward
    drew random numbers (it said so from the module's kind alone, and a mistake beside it read `random_forward`)."""
    code, out, found = audited(tmp_path, store, capsys, "--case", "unused_dropout")
    assert code == 0 and found["verdicts"] == ["exact"] and not found["notes"], out
    assert "drew random numbers" not in out, out


@pytest.mark.slow
@pytest.mark.parametrize("case", [("counter",), ("dropout", "--drops", "1")])
def test_a_mistake_beside_a_counter_or_one_dropout_layer_is_still_named(case, tmp_path, store, capsys):
    """A buffer the forward updates but never reads, and one dropout layer (its masks drawn in the same order), do not
    hide an undivided loss: a difference by a factor of k is no difference of state or of random numbers (it read as
    `stateful_forward` and `random_forward`)."""
    code, out, found = audited(tmp_path, store, capsys, "--case", *case, "--undivided", "yes")
    assert code == 1 and found["verdicts"] == ["loss_not_divided"], out


@pytest.mark.parametrize("modules, drawn", [([], ["torch"]), (["2: Dropout(p=0.1)"], ["torch", "random"]),
                                            ([], ["numpy"])])
def test_the_sentences_of_a_random_forward_say_what_drew_and_never_judge_the_loop(modules, drawn):
    """random_forward and random_across_ranks name the generators and what drew (a functional draw, the forward's
    own code) and say the loop cannot be told right or wrong; neither says the loop is right or has no mistake."""
    from batchsweep.sweeps.audit.traces import random_figures
    from batchsweep.sweeps.audit.verdicts import sentence
    from batchsweep.sweeps.launch.observed import Trace

    trace = Trace(random_modules=modules, random_draws=["forward"], random_generators={"forward": drawn})
    figures = {"nproc": 2, **random_figures(trace)}
    for verdict in ("random_forward", "random_across_ranks"):
        said = sentence(verdict, figures)
        judged = said.replace("whether the loop is right", "")  # (the one way it may be named: as not told)
        assert "cannot be told" in said and "no mistake" not in judged and " right" not in judged, said
        assert "exact" not in judged and "is wrong" not in judged, said
        assert ("no module random by kind" in said) == (not modules), said
        assert ("a functional draw in the forward" in said) == (not modules and "torch" in drawn), said
    assert figures["random_generators"] == ", ".join(drawn)


@pytest.mark.slow
def test_a_random_forward_whose_weights_agree_but_gradients_part_is_no_mistake(tmp_path, store, capsys):
    """Two dropout layers at LR 1e-5 in float32: the weights agree within 1e-5 after an epoch, the windows'
    gradients part (0.94x, cosine 0.98). That path skipped the randomness and named mean_of_micro_batch_means (exit
    1), with a note that the runs "agreed all the same"; any measure that parts them is the randomness's."""
    code, out, found = audited(tmp_path, store, capsys, "--case", "dropout", "--drops", "2", "--dtype", "float32",
                               "--lr", "1e-5", "--epochs", "1")
    assert code == 2 and found["verdicts"] == ["random_forward"], out
    assert "first_differing_gradient" in found and not found["notes"] and "agreed all the same" not in out, out


@pytest.mark.slow
@pytest.mark.parametrize("case", ["target_noise", "teacher"])
def test_draws_in_the_step_outside_the_forward_are_named_never_a_mistake(case, tmp_path, store, capsys):
    """Noise on the targets after the forward, and a teacher's dropouts under no_grad (left in training mode): the
    step draws another count of numbers at (b, k) than at (b*k, 1) on the same samples, and the runs part. They
    read as mean_of_micro_batch_means and unexplained (exit 1); the draw in the step is named (exit 2)."""
    code, out, found = audited(tmp_path, store, capsys, "--case", case, "--epochs", "1")
    assert code == 2 and found["verdicts"] == ["random_step"], out
    assert found["step_generators"] == "torch's default generator" and "cannot be told" in out, out


@pytest.mark.slow
def test_a_forward_that_moves_the_batches_generator_is_named_not_the_data(tmp_path, store, capsys):
    """Micro-batches drawn by torch.randint in the step, two dropouts in the forward: the masks move the generator
    between the batch draws, so window 1 holds other samples. That read data_differs, blaming an augmentation or
    draws before training; the forward's dropouts are named, and what to do."""
    code, out, found = audited(tmp_path, store, capsys, "--case", "random_batches", "--drops", "2", "--epochs", "1")
    assert code == 2 and found["verdicts"] == ["random_forward"] and found["data_window"] == 1, out
    assert found["random_modules"] == "2: Dropout(p=0.1), 3: Dropout(p=0.1)", out
    assert "moved the generator the batches are drawn from" in out and "Switch the randomness off" in out, out


@pytest.mark.slow
def test_the_zero_grad_signature_without_a_zero_grad_seen_is_not_named(tmp_path, store, capsys):
    """A LayerDrop drawn from a np.random.default_rng object of the script's own, which the tracer does not watch:
    its gradients look like a zero_grad per micro-batch (r 0.59), but the tracer saw one zero_grad a window. It was
    named (exit 1) on a correct loop; now the audit says it cannot tell, and what else makes that signature."""
    code, out, found = audited(tmp_path, store, capsys, "--case", "layerdrop", "--rng", "generator", "--epochs", "1")
    assert code == 2 and found["verdicts"] == ["zero_grad_unseen"], out
    assert "p.grad = None" in out and "np.random.default_rng()" in out and "these runs do not tell" in out, out


@pytest.mark.slow
def test_a_mistake_found_beside_a_random_forward_exits_1(tmp_path, store, capsys):
    """A short window never stepped, two dropouts beside it: the step counts name the mistake, the dropouts hide
    the rest. It exited 2 (cannot be audited), which a CI gate may let through; a mistake found exits 1."""
    code, out, found = audited(tmp_path, store, capsys, "--case", "skip_tokens", "--drops", "2")
    assert found["verdicts"] == ["short_window_skipped", "random_forward"] and code == 1, out


@pytest.mark.slow
@pytest.mark.parametrize("case, named", [(("late_dropout", "--drops", "2", "--dropout", "0"),
                                          "2: Dropout(p=0.1) from a later step"),
                                         (("attention",), "attention: MultiheadAttention(dropout=0.1)")])
def test_modules_random_by_kind_are_named_late_or_without_a_dropout_module(case, named, tmp_path, store, capsys):
    """Dropout's p raised from 0 after step 4 draws nothing in the first windows the tracer watches: it read
    unexplained (exit 1); the modules listed again at the run's end name it. nn.MultiheadAttention's dropout is a
    float, no Dropout module: it was said "no module random by kind"."""
    code, out, found = audited(tmp_path, store, capsys, "--case", *case, "--epochs", "1")
    assert named in out and "no module random by kind" not in out, out
    if case[0] == "late_dropout":  # (drawn after the first windows, where the generators are watched: inferred)
        assert code == 2 and found["verdicts"] == ["random_forward"] and "drew random numbers (or may have" in out


@pytest.mark.slow
def test_modules_random_by_kind_that_draw_from_a_generator_of_their_own_say_it_cannot_be_told(tmp_path, store, capsys):
    """Two dropout layers drawing from one torch.Generator of the script's own: no default generator moves, so the
    forward's draws were not seen, but the modules random by kind were; it read `unexplained`, exit 1, on a
    correct loop."""
    code, out, found = audited(tmp_path, store, capsys, "--case", "own_generator")
    assert code == 2 and found["verdicts"] == ["random_forward"], out
    assert "OwnDrop(p=0.1)" in out and "a generator of their own" in out, out
