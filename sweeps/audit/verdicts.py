"""The verdicts: each one's exit status and sentence, and a finding (the verdicts of one audit with their figures)
turned into what the audit prints."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .compare import CLIPPED

# An epoch's last LR below this share of its largest, in a schedule the study's epochs do not stretch: `exact` says
# that the last window was checked at that size (transformers' linear schedule over 13 steps ends at 1/13).
TAIL = 0.1


# name: (exit status: 0 right, 1 a mistake, 2 cannot be audited; what it means and what to do)
VERDICTS = {
    "exact": (0, "(b, k) equals (b*k, 1) within the tolerance of {dtype}: the accumulation is exact."),
    "zero_grad_per_micro_batch": (1, "zero_grad() runs inside the micro-batch loop, so only the last micro-batch "
                                     "of each window reaches the step: zero the gradients once per window, "
                                     "after step()."),
    "loss_not_divided": (1, "each window's update is k times the true batch's: the micro-batch losses are added "
                            "up undivided. Divide each micro-batch's summed loss by the window's number of items "
                            "(or its mean loss by k). The windows' gradients, before any clipping and before the "
                            "optimizer, say it: Adam's update and clip_grad_norm_ hide the scale, the gradient does "
                            "not."),
    "short_window_divided_by_k": (1, "full windows agree, but the short last window of an epoch is scaled by (its "
                                     "micro-batches)/k: it is divided by k instead of by its own count. Divide "
                                     "by the number of items in each window (Lightning's accumulate_grad_batches, "
                                     "#19987, and Accelerate's accumulate() do this)."),
    "mean_of_micro_batch_means": (1, "windows whose micro-batches hold different numbers of counted items (tokens "
                                     "with padding, or a loss weighted by class, whose mean divides by the "
                                     "micro-batch's sum of weights) differ: the loss is a mean of micro-batch "
                                     "means. Sum the per-item losses and divide by the window's total count of "
                                     "items (its sum of weights). Where every micro-batch counts alike, look for a "
                                     "term that the loss adds once per micro-batch (a router's auxiliary loss, "
                                     "say): a window adds it k times, the true batch once; divide it by k."),
    "step_per_micro_batch": (1, "the optimizer steps once per micro-batch ({steps_accumulated} steps an epoch "
                                "against {steps_true_batch}): step() and zero_grad() belong after the last "
                                "micro-batch of a window."),
    "short_window_skipped": (1, "the accumulated run made {steps_accumulated} optimizer steps against the "
                                "true batch's {steps_true_batch}: an epoch's last window, shorter than k "
                                "micro-batches, never steps (a step only when (i + 1) % k == 0), so its samples "
                                "are lost, or their gradient is added to the next epoch's first window. Step after "
                                "the epoch's last micro-batch too, dividing by that window's own count of items."),
    "short_window_extra": (1, "the accumulated run made {steps_accumulated} optimizer steps an epoch against the "
                              "true batch's {steps_true_batch}: its micro-batches fill a short last window from "
                              "samples that the true batch drops (a loader with drop_last=True drops fewer samples "
                              "in batches of b than of b*k), so the two cannot agree. Keep the last batch "
                              "(drop_last=False), or drop the short window at (b, k) too."),
    "nothing_accumulated": (2, "an epoch at this --physical-batch is a single micro-batch (the run at (b, 1) made "
                               "one step): the accumulated run's one window held that micro-batch alone, and "
                               "equals the true batch whatever the loop does, so nothing was tested. Audit with a "
                               "--physical-batch of at most 1/k of the training set, so that a window holds k "
                               "micro-batches."),
    "batchnorm": (0, "the model has BatchNorm in training mode, and the first step differs: (b, k) normalizes "
                     "each micro-batch of b, which (b*k, 1) cannot equal, and updates its running statistics k "
                     "times a step. Compare against a ghost-batch twin (BatchNorm over chunks of b), or use "
                     "GroupNorm or LayerNorm where the two must agree."),
    "schedule_per_micro_batch": (1, "the learning-rate schedule does not follow the optimizer steps: at step "
                                    "{lr_step} the accumulated run's LR is {lr_a:.4g} against the true batch's "
                                    "{lr_t:.4g}. It counts micro-batches (a scheduler.step() per micro-batch, or a "
                                    "length of len(loader)): step it once per window, after optimizer.step(), "
                                    "over a length in windows."),
    "lr_differs": (1, "the script sets another learning rate at (b, k) than at (b*k, 1), {lr_a:.4g} against "
                      "{lr_t:.4g} from step {lr_step} on: it scales the LR it is given by k or b itself. Use the LR it "
                      "is given (a study's lr_rule scales it), and the audit compares like with like."),
    "weight_penalty_per_micro_batch": (1, "the accumulated update differs from the true batch's by "
                                          "{weight_penalty_share:.3g} of the {penalized}, a multiple of them: "
                                          "a penalty on the weights in the loss (λ‖w‖²) or a decay of them, "
                                          "applied once per micro-batch, which a window applies k times and the "
                                          "true batch once. Apply it once per window (or divide it by k), or leave "
                                          "it to the optimizer's weight_decay."),
    "update_scaled": (1, "the accumulated update has exactly the true batch's direction but {update_ratio:.7g} "
                         "times its length: the learning rate differs (a schedule stepped per micro-batch? print "
                         "\"lr\" in each row and the audit tells) or the loss is divided by another number than "
                         "the window's count of items."),
    "differs_under_clipping": (1, "the accumulated update has the true batch's length (|Δa| / |Δt| = "
                                  "{update_length_ratio:.7f}) but not its direction (cosine {update_cosine:.4g}): "
                                  "gradient clipping (clip_grad_norm_; transformers' max_grad_norm is 1.0 by "
                                  "default) cut both to its threshold, and what it cut differed. Clipping inside "
                                  "the micro-batch loop does this (each micro-batch's partial sum is cut: clip "
                                  "once per window, after its last backward() and before step()), and so does a "
                                  "mistake in how the loss is divided beneath the clip. Audit with clipping off: "
                                  "exact then, the clip is in the wrong place; otherwise the mistake of the loss "
                                  "is named."),
    "within_rounding": (2, "the runs part at update {first_differing_update} by {update_difference:.2g} of the true "
                           "batch's update: no more than reduced-precision arithmetic makes by itself between two "
                           "batch shapes (autocast to bf16 or fp16, and TF32, which GPUs use for convolutions by "
                           "default, keep about 3 significant digits), so in {dtype} a mistake cannot be told from "
                           "rounding. Audit in float64, or in float32 with autocast off and TF32 off "
                           "(torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False)."),
    "accumulated_step_skipped": (1, "the accumulated run's update {first_differing_update} left every weight as it "
                                    "was, where the true batch's moved them: its step was skipped, as a GradScaler "
                                    "(fp16) skips a step whose gradients overflowed. A correct loop's micro-batches, "
                                    "each a sum over fewer samples than the true batch's, overflow no sooner than it: "
                                    "these gradients were larger than the true batch's, as a loss not divided by k "
                                    "makes them. Audit with the GradScaler off (bf16 autocast, or float32), where the "
                                    "mistake is named."),
    "true_batch_step_skipped": (2, "the true batch's update {first_differing_update} left every weight as it was, "
                                   "where the accumulated run's moved them: a GradScaler (fp16) skips a step whose "
                                   "gradients overflowed, and the true batch's fp16 sums over b*k samples overflow "
                                   "sooner than a micro-batch's over b. That is no mistake of the loop, and the runs "
                                   "part there whatever the loop does: audit with the GradScaler off (bf16 "
                                   "autocast, or float32), or with a lower init_scale."),
    "clip_per_micro_batch": (1, "clip_grad_norm_ runs more than once a window (first at step {clip_step}): it cuts "
                                "each micro-batch's partial sum of the gradient, not the window's. Clip once per "
                                "window, after its last backward() and before step()."),
    "data_differs": (2, "the two runs' window {data_window} did not hold the same samples (their count or the sums "
                        "of their inputs differ), so (b, k) cannot be compared with (b*k, 1) there, whatever the "
                        "loop does; the script repeats itself at (b*k, 1), so this is no unseeded randomness in "
                        "general. Usually it is random draws before training whose number depends on b (an "
                        "evaluation over random batches of b samples, torch.randint(..., (b,))) that move the "
                        "generator the training data are drawn from. Draw the training batches from a generator "
                        "of their own, seeded from {{seed}}, or switch such an evaluation off for the audit."),
    "random_forward": (2, "the training forward drew random numbers {random_drew}, and the runs part: at (b, k) "
                          "each micro-batch's forward draws its own, k forwards a window against one at (b*k, 1), "
                          "in another order or number (two dropout layers draw layer 1 then layer 2 for each "
                          "micro-batch, against layer 1 for all samples then layer 2; a LayerDrop draws once a "
                          "forward), so the two may have trained on other random numbers, and whether the loop is "
                          "right cannot be told from these runs: a mistake of the loop would look the same. Switch "
                          "the randomness off for the audit (this model's config: {random_fields}; transformers' "
                          "configs: every *dropout*, *pdrop* and *layerdrop* field; timm: drop_rate and "
                          "drop_path_rate), or draw it per sample from a generator seeded by {{seed}} and the "
                          "sample's index (one generator of its own for the whole run draws in another order too, "
                          "and the audit does not watch it)."),
    "random_step": (2, "the training step drew random numbers from {step_generators} outside the forward, between "
                       "the micro-batches' forwards (noise on the targets or on the gradients, a teacher model left "
                       "in training mode under no_grad, a random mask on the loss), and the runs part: at (b, k) "
                       "those draws come k times a window, over b samples each, against once over b*k at (b*k, 1), "
                       "and torch draws some kinds (randn: in blocks of 16) by another path for another count, so "
                       "the two may have trained on other random numbers, and whether the loop is right cannot be "
                       "told from these runs: a mistake of the loop would look the same. Switch those draws off for "
                       "the audit (a teacher: teacher.eval()), or draw them per sample from a generator seeded by "
                       "{{seed}} and the sample's index."),
    "zero_grad_unseen": (2, "the first differing update matches zero_grad_per_micro_batch (the accumulated one is "
                            "{update_ratio:.4g} x the true batch's along it, at cosine {update_cosine:.4g}), but "
                            "the tracer saw one zero_grad() a window, so that mistake is not named. The same "
                            "signature comes from the gradients dropped by hand in the micro-batch loop "
                            "(p.grad = None), and from randomness the tracer does not watch: a generator object of "
                            "the script's own (np.random.default_rng(), random.Random(), a torch.Generator) drawn "
                            "in the forward or the step. Which one, these runs do not tell: drop the gradients "
                            "only after step(), switch such randomness off for the audit, and audit again."),
    "stateful_forward": (2, "buffers that the model's training forward updates ({stateful_buffers}) differ between "
                            "the runs where they part: at (b, k) each micro-batch's forward updates them, k times a "
                            "window, against once at (b*k, 1) (spectral_norm's power iteration, a running average), "
                            "and where the forward reads them the runs differ whatever the loop does, as BatchNorm "
                            "makes them. A mistake of the loop cannot be told apart from it: audit with those modules "
                            "removed or in eval mode."),
    "unexplained": (1, "the runs differ, and the difference matches none of the known mistakes: see the figures."),
    # Across ranks (--nproc N): (b, k) on N ranks, each rank's weights against rank 0's, and (b*k, 1) on N ranks
    # against (b*k*N, 1) on one rank.
    "grads_not_synced": (1, "rank {rank_parted}'s weights part from rank 0's at the accumulated run's update "
                            "{rank_first_parting} ({rank_rel_diff:.3g} of them after {steps_accumulated} steps), "
                            "where the true batch's ranks agree. DDP steps every rank with the same all-reduced "
                            "gradient from the "
                            "same start, so some micro-batch's gradient was never all-reduced. DDP reads no_sync() "
                            "and require_backward_grad_sync in the forward: a flag set after the model's call leaves "
                            "that micro-batch's backward local, and with static_graph=True no_sync() can stop the "
                            "all-reduce for good (PyTorch #187732). Switch the sync off for every micro-batch but "
                            "the window's last, before its forward."),
    "ranks_train_apart": (2, "the ranks' weights part at (b*k, 1) too (rank {rank_parted}: {rank_rel_diff:.3g} at "
                             "(b, k), {true_batch_rank_rel_diff:.3g} at (b*k, 1)): the script does not all-reduce "
                             "the gradients of the window's last micro-batch, which at (b*k, 1) is its only one (no "
                             "DistributedDataParallel, its sync switched off throughout, or switched on at another "
                             "micro-batch than the last), so its ranks train apart and cannot be compared with one "
                             "rank. Sync at the window's last micro-batch (a data-parallel script), or audit this "
                             "one with --nproc 1."),
    "mean_of_rank_means": (1, "(b*k, 1) on {nproc} ranks parts from (b*k*{nproc}, 1) on one rank at update "
                              "{rank_first_differing_update}, whose window the ranks held with {rank_counts} counted "
                              "items, and the {rank_measured} is turned (cosine {rank_update_cosine:.6f}, "
                              "{rank_update_ratio:.4g} x the one rank's along it): each rank divides its loss by its "
                              "own count, and DDP's mean of the ranks' gradients weights a rank of few items as one "
                              "of many. Divide each rank's summed loss by the window's count over all ranks "
                              "(all_reduce it), times {nproc} (transformers: average_tokens_across_devices=True)."),
    "loss_scaled_by_world": (1, "the {rank_measured} on {nproc} ranks is {rank_update_ratio:.4g} x the global "
                                "batch's (one rank at b*k*{nproc}), in its direction (cosine "
                                "{rank_update_cosine:.6f}), from update {rank_first_differing_update} on: the loss "
                                "is scaled by the world size once more than DDP's mean of the ranks' gradients "
                                "allows (multiplied by it, or divided by it as transformers' nn.DataParallel loss "
                                "was, #37474). DDP averages the ranks' gradients: each rank's loss is its summed "
                                "loss over the window's count on all ranks, times {nproc}."),
    "ranks_data_differ": (2, "window {rank_data_window} of the {nproc} ranks at (b*k, 1) did not hold together the "
                             "samples that one rank holds at (b*k*{nproc}, 1) (their counts, or the sums of their "
                             "inputs, differ), so the reduction across ranks cannot be checked. The usual causes: "
                             "each rank draws its own samples (minimal GPT trainers seed each rank's batches with 1337 "
                             "+ its rank), or the order depends on the world size or on b; which one, these runs do "
                             "not tell. For the audit, shard each window by rank as DistributedSampler does (rank r "
                             "takes samples r, r + {nproc}, r + 2*{nproc}, ... of one permutation, seeded alike on "
                             "every rank and at every world size)."),
    "lr_differs_by_world": (2, "on {nproc} ranks the script sets another learning rate than on one rank, {lr_a:.4g} "
                               "against {lr_t:.4g} from step {lr_step} on (it scales the LR it is given by the world "
                               "size), so the reduction across ranks cannot be compared like with like: audit with "
                               "the LR it is given."),
    "batchnorm_across_ranks": (2, "the model has BatchNorm in training mode: each of the {nproc} ranks normalizes "
                                  "its own b*k samples, which one rank at b*k*{nproc} cannot equal, so whether the "
                                  "loss is reduced right across ranks cannot be told from these runs (a loss scaled "
                                  "by {nproc}, or a mean of the ranks' means, would pass). Audit it with BatchNorm "
                                  "frozen (eval mode), where the reduction is checked; where the ranks must agree "
                                  "with one, convert it with torch.nn.SyncBatchNorm.convert_sync_batchnorm (GPUs)."),
    "random_across_ranks": (2, "the training forward drew random numbers {random_drew}, and {nproc} "
                               "ranks part from one: each rank draws from its own generator, so they trained on "
                               "other random numbers than one rank, and whether the loop is right across ranks "
                               "cannot be told from them: a mistake would look the same. Switch the randomness off "
                               "for the audit (this model's config: {random_fields})."),
    "rounding_across_ranks": (2, "(b*k, 1) on {nproc} ranks parts from (b*k*{nproc}, 1) on one rank at update "
                                 "{rank_first_differing_update} by {rank_update_difference:.2g} of its "
                                 "{rank_measured}: no more than {dtype} arithmetic makes by itself where the ranks' "
                                 "sums are added in another order, so a mistake of the reduction across ranks cannot "
                                 "be told from rounding. Audit in float64."),
    "unexplained_across_ranks": (1, "(b*k, 1) on {nproc} ranks parts from (b*k*{nproc}, 1) on one rank at update "
                                    "{rank_first_differing_update} ({rank_update_ratio:.4g} x the one rank's "
                                    "{rank_measured} along it, cosine {rank_update_cosine:.6f}; the ranks' windows "
                                    "held {rank_counts} counted items), in a way that matches none of the known "
                                    "mistakes of the reduction across ranks: see the figures."),
    "not_reproducible": (2, "two runs of (b*k, 1) with the same values differ by {repeat_rel_diff:.3g}: the "
                            "script is not deterministic (an unseeded shuffle or augmentation, randomness drawn "
                            "from an unseeded generator, nondeterministic GPU kernels), so no difference between "
                            "(b, k) and (b*k, 1) can be told from it. Seed everything from {{seed}} (or call "
                            "torch.use_deterministic_algorithms(True)) and audit again."),
}


@dataclass
class Finding:
    verdicts: list[str]  # every fault found, in the order met (or the one verdict of a loop without any)
    figures: dict[str, Any]
    compared: list[tuple[str, float]]  # (what, relative weight difference)
    notes: list[str] = field(default_factory=list)  # what the trace saw that the measurements did not bear out

    @property
    def verdict(self) -> str:
        return self.verdicts[0]

    @property
    def status(self) -> int:
        """1 where a verdict is a mistake (found beside what cannot be audited, it still fails a CI gate), else the
        worst of the verdicts' exit statuses: 2 (cannot be audited) over 0."""
        codes = {VERDICTS[v][0] for v in self.verdicts}
        return 1 if 1 in codes else max(codes)


# The call each verdict concerns, named with the place in the script where the tracer saw it made.
CALLS = {"zero_grad_per_micro_batch": "zero_grad()", "step_per_micro_batch": "step()",
         "schedule_per_micro_batch": "the scheduler's step()", "clip_per_micro_batch": "clip_grad_norm_()"}
BACKWARD = ("loss_not_divided", "short_window_divided_by_k", "mean_of_micro_batch_means",
            "weight_penalty_per_micro_batch", "update_scaled")  # a mistake of the loss: its backward()'s place


def site(verdict: str, figures: dict[str, Any]) -> str:
    """Where the script makes the call a verdict concerns ("zero_grad() at train.py:212"), or "" where unknown."""
    where = figures.get(f"{verdict}_at") or (figures.get("backward_at") if verdict in BACKWARD else None)
    if not where:
        return ""
    if verdict == "short_window_skipped":  # (its figure says which call leaves the window)
        return where
    return f"{CALLS.get(verdict, 'backward()')} at {where}"


def sentence(verdict: str, figures: dict[str, Any]) -> str:
    """The verdict's sentence; for an unexplained difference at the epoch's last update only, where to look; for
    a scaled update of the true batch's length, or an unexplained one in the signs of its steps, what hides the
    scale. Where the windows' gradients were compared, the figures it cites are theirs."""
    f = dict(figures)
    gradient = "gradient_ratio" in f and verdict in GRADIENT_FIGURES
    if gradient:
        f.update({key: f[key.replace("update", "gradient")] for key in GRADIENT_FIGURES[verdict]})
    if "rank_gradient_ratio" in f:  # across ranks: the windows' gradients decided (update figures stay beside)
        f.update({f"rank_update_{x}": f[f"rank_gradient_{x}"] for x in ("ratio", "cosine", "difference")})
    f["rank_measured"] = "window's gradient (before any clipping)" if "rank_gradient_ratio" in f else "update"
    sentence = VERDICTS[verdict][1].format(**f)
    if verdict == "grads_not_synced" and "rank_parting_window" in f:
        sentence = SHORT_UNSYNCED.format(**f)
    if verdict == "data_differs" and "step_generators" in f:
        sentence = DRAWN_IN_STEP.format(**f)
    if verdict == "random_forward" and "data_window" in f:
        sentence += (f" These draws also moved the generator the batches are drawn from: window {f['data_window']} "
                     "held other samples in the two runs (k forwards draw between a window's batch draws at (b, k), "
                     "one at (b*k, 1)).")
    if "rank_weights_agree" in f and verdict in ACROSS_MEASURED:
        clip = f["rank_weights_agree"]
        sentence += f" The weights on {f['nproc']} ranks and on one agree all the same: " + (
            f"clip_grad_norm_ at {clip:g} cut both windows' gradients to that norm, which hides their scale; once "
            "a gradient's norm is below it, as it falls in training, the updates differ as the gradients do."
            if clip else "the optimizer's update hides the gradients' scale (Adam's is about the LR on every weight "
            "whatever the scale).")
    if gradient:
        sentence = sentence.replace("update", "gradient (before clipping)", 1)
    where = site(verdict, f)
    if where:
        sentence += f" Seen at: {where}."
    finding = Finding([verdict], f, [])
    if finding.verdict == "unexplained" and 1 < f.get("first_differing_update", 0) == f["steps_true_batch"]:
        sentence += (" Only the epoch's last update differs: look at its last window, the short one where the "
                     "epoch's micro-batches are not a multiple of k. Adam, and SGD with Nesterov's momentum, hide how "
                     "it was scaled: audit with SGD without Nesterov (its momentum and weight decay are taken out) "
                     "to have it named. Where the training set is not a multiple of b, that window also ends in a "
                     "short micro-batch, which a mean of micro-batch means (each one's mean loss over k, or over the "
                     "window's micro-batches) weights as a full one: that turns the update, under SGD too.")
    sizes = f["update_magnitude_difference"] / f["update_difference"] if "update_difference" in f else 1.0
    if finding.verdict == "unexplained" and sizes < 0.5:  # sign-like updates
        sentence += (f" The updates differ in the signs of the weights' steps more than in their sizes ({sizes:.2g} "
                     "of the difference): Adam's first update is about the LR on every weight whatever the gradient "
                     "(Lion's every update is), which hides the scale that names a mistake: audit with SGD to have "
                     "it named.")
    if finding.verdict == "exact" and f.get("last_lr_share", 1.0) < TAIL:
        sentence += (f" The epoch's last update ran at {f['last_lr_share']:.2g} of its largest LR, and the schedule "
                     "does not follow {epochs} (it decays per step, or over {max_steps}, as transformers' Trainer "
                     "builds it): a mistake of the epoch's last window moves the weights that much less there. "
                     "Audit with a constant LR (transformers: lr_scheduler_type=\"constant\") to check that window "
                     "at full size.")
    if finding.verdict == "update_scaled" and abs(f["update_ratio"] - 1) < CLIPPED and not gradient:
        sentence += (f" Both updates have the same length to within {abs(f['update_ratio'] - 1):.2g}: gradient "
                     "clipping (clip_grad_norm_; transformers' max_grad_norm is 1.0 by default) cuts both to its "
                     "threshold, and Adam's first update is about the LR on every weight whatever the gradient "
                     "(Lion's every update is), which hides how the loss was divided: audit with clipping off and "
                     "with SGD to have the mistake named.")
    return sentence


# grads_not_synced where the ranks part first at a window of fewer than k micro-batches, the full ones before it
# all-reduced: the loop counts to k to switch the sync on (nanoGPT's micro_step == grad_accum_steps - 1 over
# islice(loader, k)), which the epoch's short last window never reaches.
SHORT_UNSYNCED = ("rank {rank_parted}'s weights part from rank 0's ({rank_rel_diff:.3g} of them after "
                  "{steps_accumulated} steps) at the accumulated run's update {rank_first_parting}, whose window "
                  "holds {rank_parting_window} micro-batches, fewer than k (a short window: an epoch's last, where "
                  "its micro-batches are not a multiple of k). The windows before it kept every rank's weights "
                  "equal, and the true batch's ranks agree, so none of that window's gradients was all-reduced: the "
                  "sync is switched on at micro-batch k (as micro_step == grad_accum_steps - 1 does), which a "
                  "shorter window never reaches. Switch it on at each window's own last micro-batch: take the "
                  "window first (micro = list(islice(loader, k))) and test micro_step == len(micro) - 1, or keep "
                  "no_sync() for all but the last batch the iterator gives.")


# data_differs where a run's training step drew random numbers between its forwards in the first windows: an
# augmentation there, or batches drawn there (alike in both runs) after draws before training moved the generator.
DRAWN_IN_STEP = ("the two runs' window {data_window} did not hold the same samples (their count or the sums of their "
                 "inputs differ), so (b, k) cannot be compared with (b*k, 1) there, whatever the loop does; the "
                 "script repeats itself at (b*k, 1), so this is no unseeded randomness in general. The training step "
                 "drew from {step_generators} between its forwards (before a micro-batch's forward, in the first "
                 "windows). A random augmentation drawn there (a scale or mixup's λ per batch, noise on the inputs) "
                 "draws k times a window at (b, k), over b samples each, against once at (b*k, 1), and torch draws "
                 "some kinds per element by another path for another count (randn: in blocks of 16), so the windows "
                 "can hold other inputs: draw it per sample from a generator seeded by {{seed}} and the sample's "
                 "index, or "
                 "switch it off for the audit. Where those draws only pick the batches (torch.randint, as minimal "
                 "GPT trainers draw them), both runs draw them alike, and the cause is random draws before training "
                 "whose number depends on b (an evaluation over random batches of b samples) that move the "
                 "generator the batches are drawn from: draw the training batches from a generator of their own, "
                 "seeded from {{seed}}, or switch such an evaluation off. Which of the two, these runs do not tell.")


# The verdicts across ranks that the first differing update (or window's gradient) of N ranks against one names.
ACROSS_MEASURED = ("loss_scaled_by_world", "mean_of_rank_means", "unexplained_across_ranks", "rounding_across_ranks")


# The verdicts whose sentence cites the figures of the compared updates: the gradients' where they were compared.
GRADIENT_FIGURES = {"update_scaled": ("update_ratio",), "zero_grad_unseen": ("update_ratio", "update_cosine"),
                    "weight_penalty_per_micro_batch": (),
                    "differs_under_clipping": ("update_length_ratio", "update_cosine")}


# weight decay's shares in the figures: (of what, where it was on one kind of tensor only: what else)
DECAYED = {"weight_decay_share": ("weights", ""),
           "weight_decay_2d_share": ("matrices", "; none measurable on the 1-D tensors"),
           "weight_decay_1d_share": ("1-D tensors", "; none measurable on the matrices")}


def taken_out(f: dict[str, Any]) -> str:
    parts = [f"{f['momentum_share']:.3g} of the update before (momentum)"] if "momentum_share" in f else []
    decayed = [key for key in DECAYED if key in f]
    if decayed:
        alone = DECAYED[decayed[0]][1] if len(decayed) == 1 else ""
        parts.append(f"{' and '.join(f'{-f[key]:.3g} of the {DECAYED[key][0]}' for key in decayed)} "
                     f"(weight decay{alone})")
    return f", once what both updates hold besides this step's gradient is taken out: {' and '.join(parts)}" \
        if parts else ""
