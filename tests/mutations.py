"""Does the suite bite? Each deliberate bug below is planted in a scratch copy of the repository (never in the
working tree), the test meant to catch it runs there, and the bug counts as caught when that test fails.

    .venv/bin/python tests/mutations.py            # every bug, about 40 minutes on 2 cores (47 in 38 min, 2026-12-03)
    .venv/bin/python tests/mutations.py loss       # only the bugs whose name contains "loss"

Not part of `make test`: each bug costs a test run. A bug whose code has moved (its `old` text is gone) is
reported as such: update the table in tests/README.md and here together.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HUNG_SECONDS = 600
"""A mutant's test still running after this long hangs (no test here takes more than about a minute)."""


@dataclass(frozen=True)
class Bug:
    name: str
    path: str
    old: str
    new: str
    test: str


BUGS = [
    Bug("an elastic step's uneven shares weighted as even ones", "worker/train/step.py",
        "loss = loss * (inputs.shape[0] * self.world_size / step_examples)", "loss = loss / len(micro_batches)",
        "tests/integration/test_elastic_exchange.py"),
    Bug("an elastic step's shares overlap by one example", "worker/train/data.py",
        "return order[start + rank:start + examples:world_size]",
        "return order[start + rank:start + examples + 1:world_size]",
        "tests/unit/test_elastic.py::test_each_example_of_an_epoch_once_across_size_changes"),
    Bug("a regroup's state taken from the survivor least far on", "worker/train/membership.py",
        "source = min(survivors, key=lambda slot: (-registered[slot], slot))",
        "source = min(survivors, key=lambda slot: (registered[slot], slot))",
        "tests/unit/test_elastic.py::test_plan_generation"),
    Bug("a stalled member's heartbeat never noticed", "worker/train/membership.py",
        "if beats.still_for(slot, count, now) > STALL_SECONDS and",
        "if beats.still_for(slot, count, now) > 1000 * STALL_SECONDS and",
        "tests/integration/test_elastic_local.py::test_a_stopped_rank_is_left_behind_within_seconds_and_rejoins_when_it_wakes"),
    Bug("an elastic job's lost rank restarts the whole group", "operator/training.py",
        "elif self.spec.regroups and self._follow_elastic_ranks():", "elif False:",
        "tests/unit/test_training_reconcile.py::test_reconcile"),
    Bug("an elastic job's lost rank 0 restarts the whole group (as when it hosted the store)", "operator/training.py",
        'failed = [p for p in kept if p.phase == "Failed" and not p.terminating]',
        'failed = [p for p in kept if p.index != 0 and p.phase == "Failed" and not p.terminating]',
        "tests/unit/test_training_reconcile.py::test_reconcile"),
    Bug("an elastic job's failed coordinator left unnoticed (the ranks wait on a store that is gone)",
        "operator/training.py", "elif (lost := self._coordinator_lost()) is not None:", "elif False:",
        "tests/unit/test_training_reconcile.py::test_reconcile"),
    Bug("a member behind the source keeps its own sharedGradients threshold", "worker/train/modes.py",
        "self.compression.load_state_dict({**self.compression.state_dict(), **shared})",
        "self.compression.load_state_dict({**shared, **self.compression.state_dict()})",
        "tests/unit/test_elastic.py::test_sharedgradients_members_take_the_sources_threshold_and_keep_their_own_residuals"),
    Bug("an abandoned evaluation leaves the model training in eval mode", "worker/train/evaluation.py",
        "    finally:\n        model.train(was_training)\n",
        "    except BaseException:\n        raise\n    model.train(was_training)\n",
        "tests/integration/test_elastic_local.py::test_a_rank_frozen_in_a_checkpoints_evaluation_is_left_behind_within_seconds"),
    Bug("a checkpoint's evaluation waits for a frozen peer until the group's timeout", "worker/train/evaluation.py",
        "wait(dist.all_reduce(totals, async_op=True))", "dist.all_reduce(totals)",
        "tests/integration/test_elastic_local.py::test_a_rank_frozen_in_a_checkpoints_evaluation_is_left_behind_within_seconds"),
    Bug("a resume across the two sharedGradients exchanges drops this rank's byte counts", "worker/train/modes.py",
        'saved = {**saved, "residuals": {}, "velocities": {}}',
        'saved = {**saved, "residuals": {}, "velocities": {}, "bytes_sent": 0, "dense_bytes": 0}',
        "tests/unit/test_elastic.py::test_a_checkpoint_of_the_other_exchange_keeps_the_threshold_and_this_ranks_bytes_not_its_residuals"),
    Bug("the rank that becomes rank 0 when rank 0 is lost takes on none of its duties", "worker/train/trainer.py",
        "elif context.is_master and not was_rank_zero:", "elif False:",
        "tests/integration/test_elastic_local.py::test_rank_0_killed_is_replaced_alone_and_its_duties_follow_rank_0"),
    Bug("only slot 0 lets a waiting replacement in (none while slot 0 is lost)", "worker/train/membership.py",
        "        if self.rank != 0:\n            return False", "        if self.slot != 0:\n            return False",
        "tests/integration/test_elastic_local.py::test_rank_0_killed_is_replaced_alone_and_its_duties_follow_rank_0"),
    Bug("a member that has not beaten yet (still starting) counted as stalled", "worker/train/coordinator.py",
        "stalled = stalled and count > 0 and still", "stalled = stalled and still",
        "tests/unit/test_coordinator.py::test_every_member_stalled_falls_back_to_a_restart_but_not_before_they_beat"),
    Bug("a rank woken after an elastic job's end fails it (training over only once the coordinator exits)",
        "worker/local_group.py", "(self.coordinator.poll() == 0 or any(code == 0 for _, code in exits))",
        "self.coordinator.poll() == 0",
        "tests/integration/test_elastic_local.py::test_a_rank_frozen_in_the_final_checkpoint_leaves_the_others_to_write_it"),
    Bug("status.selector excludes the coordinator with != (kubectl scale cannot parse it)",
        "operator/training_objects.py", 'f"{selector_string(job)},{ROLE_LABEL} notin ({COORDINATOR_ROLE})"',
        'f"{selector_string(job)},{ROLE_LABEL}!={COORDINATOR_ROLE}"',
        "tests/integration/test_kubectl.py::test_scale_and_suspend_with_kubectl"),
    Bug("a lent worker taken back inside the stabilization window", "operator/lending.py",
        "if (now - since).total_seconds() >= window_seconds:", "if True:",
        "tests/unit/test_lending_trade.py::test_trade"),
    Bug("a job lends below minWorkers", "operator/lending.py",
        'more = min(_demand(pool, loan) - loan["workers"], left)', 'more = _demand(pool, loan) - loan["workers"]',
        "tests/unit/test_lending_trade.py::test_trade"),
    Bug("a replica still pending is lent for again on every look", "operator/lending.py",
        'more = min(_demand(pool, loan) - loan["workers"], left)', "more = min(pool.short, left)",
        "tests/unit/test_lending_trade.py::test_trade"),
    Bug("a pool the job does not select borrows its workers", "operator/lending.py",
        "return all(labels.get(key) == value for key, value in lend_to.pool_selector.match_labels.items())",
        "return True",
        "tests/unit/test_lending_trade.py::test_only_pools_whose_labels_match_the_selector_borrow_and_none_without_a_rank_pod"),
    Bug("a loan whose pool placed nothing is kept (a worker lent for nothing while the pool stays short)",
        "operator/lending.py", "if waited >= placement_seconds:", "if False:",
        "tests/unit/test_lending_trade.py::test_a_pool_that_places_nothing_with_the_lent_worker_free_gives_it_back_and_is_lent_nothing_more"),
    Bug("a pool that placed nothing is lent to again at once", "operator/lending.py",
        'if not pool.short or any(entry["name"] == pool.name for entry in unplaceable):', "if not pool.short:",
        "tests/unit/test_lending_trade.py::test_a_pool_that_places_nothing_with_the_lent_worker_free_gives_it_back_and_is_lent_nothing_more"),
    Bug("the group's size ignores the loan (the lent ranks never leave)", "operator/training.py",
        "self.size = self.spec.pods - self.loan.workers", "self.size = self.spec.pods",
        "tests/unit/test_training_reconcile.py::test_a_job_at_its_size_lends_its_highest_rank_to_a_pool_short_of_what_the_ranks_hold"),
    Bug("a job under Kueue lends its workers", "operator/training.py",
        "refused = lend_to is not None and self.queue is not None", "refused = False",
        "tests/unit/test_training_reconcile.py::test_under_kueue_a_job_lends_nothing_and_a_condition_says_why"),
    Bug("a group started again under a loan waits for the lent ranks (generation 1 at full size)",
        "operator/training.py", "world_size=self.size * self.spec.ranks_per_pod))]", "world_size=None))]",
        "tests/unit/test_training_reconcile.py::test_a_group_started_again_under_a_loan_starts_with_the_ranks_not_lent"),
    Bug("the coordinator ends its store before the ranks have read why the group restarts",
        "worker/train/coordinator.py",
        'self._wait_for_members(waiting, f"read/{generation}", LINGER_SECONDS)', "pass",
        "tests/unit/test_coordinator.py::test_fewer_than_min_workers_past_the_deadline_falls_back_to_a_restart_once_the_rank_left_has_read_why"),
    Bug("a pool's status.borrowed never written", "operator/pool_handlers.py",
        'plan.status["borrowed"] = lending.borrowed(name, jobs)', 'plan.status["borrowed"] = None',
        "tests/integration/test_lending.py"),
    Bug("batch perRank's learning rate not scaled at a smaller size", "worker/train/trainer.py",
        "state.schedule.scale = lr_scale(spec, context.world_size)", "state.schedule.scale = 1.0",
        "tests/integration/test_elastic_local.py::test_a_stopped_rank_is_left_behind_within_seconds_and_rejoins_when_it_wakes"),
    Bug("a constant learning rate left at its elastic scale once the group is whole again", "worker/train/optim.py",
        "if self.constant and self.scale == self._applied_scale:", "if self.constant and self.scale == 1.0:",
        "tests/unit/test_optim.py::test_an_elastic_scale_applies_and_a_return_to_full_size_restores_the_rate"),
    Bug("the checkpointer kept the first group's layout after a regroup", "worker/train/trainer.py",
        "checkpointer.regrouped(rank=context.rank, world_size=context.world_size)", "pass",
        "tests/integration/test_elastic_local.py::test_a_stopped_rank_is_left_behind_within_seconds_and_rejoins_when_it_wakes"),
    Bug("averaging ignores optimizer state", "worker/train/modes.py",
        "state = optimizer if self.settings.average_optimizer_state else None", "state = None",
        "tests/integration/test_trainer.py::test_replicas_are_identical_after_every_synchronisation[averaging]"),
    Bug("sharedGradients residuals and threshold not restored on resume", "worker/train/modes.py",
        'if "compression" in state:', "if False:",
        "tests/integration/test_resume.py::test_a_max_steps_stop_resumes_exactly[sharedGradients]"),
    Bug("sharedGradients velocities left out of the checkpoint", "worker/train/compression/hook_state.py",
        '"velocities": {key: velocity.detach().clone() for key, velocity in self._velocities.items()},',
        '"velocities": {},',
        "tests/integration/test_resume.py::test_a_max_steps_stop_resumes_exactly[sharedGradients]"),
    Bug("momentum factor masking zeroes the entries not sent", "worker/train/compression/accumulation.py",
        "return velocity.masked_fill_(signs != 0, 0.0)", "return velocity.masked_fill_(signs == 0, 0.0)",
        "tests/unit/test_compression_step.py::test_sparsify_and_momentum_factor_masking"),
    Bug("momentum correction's velocity gain ignored", "worker/train/compression/accumulation.py",
        "velocity = velocity.mul(momentum).add_(update, alpha=gain)", "velocity = velocity.mul(momentum).add_(update)",
        "tests/unit/test_compression_step.py::test_accumulate"),
    Bug("the calibrated threshold taken from rank 0 alone", "worker/train/compression/hook_state.py",
        "means = [sum(column) / len(values) for column in zip(*values, strict=True)]",
        "means = [column[0] for column in zip(*values, strict=True)]",
        "tests/integration/test_compression.py::test_every_correction_on_two_ranks_matches_the_algorithm_by_hand"),
    Bug("accumulated loss not divided by the number of micro-batches", "worker/train/step.py",
        "loss = loss / len(micro_batches)", "loss = loss",
        "tests/integration/test_equivalences.py::test_two_micro_batches_of_16_match_one_batch_of_32"),
    Bug("batching ignores the shape/dtype key", "worker/serve/feeds.py",
        "elif key is None or (ticket.key == key and rows + ticket.rows <= max_rows):",
        "elif key is None or rows + ticket.rows <= max_rows:",
        "tests/unit/test_inference.py::"
        "test_batched_mode_merges_requests_of_one_shape_and_dtype_and_never_mixes_shapes_or_dtypes"),
    Bug("a worker alone takes the first request back after a forward", "worker/serve/batching.py",
        "else min(batch_limit, last_rows)", "else min(batch_limit, 1)",
        "tests/unit/test_inference.py::test_a_worker_alone_waits_for_as_many_examples_as_its_last_forward_had"),
    Bug("the supervisor hands every connection to the same process", "worker/serve/processes.py",
        "self._turns[kind] = index + 1", "self._turns[kind] = index",
        "tests/integration/test_serve_processes.py::"
        "test_two_processes_share_the_ports_answer_every_connection_and_stop_together"),
    Bug("the pool's requestTimeoutMs never swept", "worker/serve/pending.py",
        "while deadlines and (deadlines[0].finished or deadlines[0].deadline <= now):",
        "while deadlines and deadlines[0].finished:",
        "tests/integration/test_server.py::test_the_pools_request_timeout_alone_answers_504_to_running_and_queued_requests"),
    Bug("dropout generator reseeded after a resume restored it", "worker/train/trainer.py",
        "        checkpointer.resume(state, context.resume_from)\n",
        "        checkpointer.resume(state, context.resume_from)\n"
        "        torch.manual_seed(trainer.seed + 1_000_003 * context.rank + state.position.step)\n",
        "tests/integration/test_resume.py::test_a_max_steps_stop_resumes_exactly[allReduce]"),
    Bug("data loader draws from the global generator", "worker/train/data.py",
        "drop_last=False,\n                      generator=torch.Generator().manual_seed(seed))", "drop_last=False)",
        "tests/integration/test_resume.py::test_a_max_steps_stop_resumes_exactly[allReduce]"),
    Bug("averaging resumes every rank from the averaged replica", "worker/train/state.py",
        'if "replica" in state:', "if False:",
        "tests/integration/test_resume.py::test_a_max_steps_stop_resumes_exactly[averaging]"),
    Bug("clipping at half the configured limit", "worker/train/step.py",
        "clip_grad_norm_(self.parameters, self.clip_norm)", "clip_grad_norm_(self.parameters, self.clip_norm / 2)",
        "tests/integration/test_equivalences.py::test_clipping_changes_an_update_exactly_when_the_norm_exceeds_the_limit"),
    Bug("a resume at another world size keeps the data position in the old size's micro-batches",
        "worker/train/data.py",
        "    return batches_done * world_size * batch_size", "    return batches_done",
        "tests/integration/test_local_restarts.py::test_a_checkpoint_written_at_another_world_size_resumes_by_examples_seen"),
    Bug("the operator's status patch carries the whole status it observed", "operator/daemon.py",
        "changed = {key: value for key, value in status.items() if current.get(key) != value}",
        "changed = {**current, **status}",
        "tests/unit/test_api_policy.py::"
        "test_publish_sends_only_the_operators_changed_fields_even_when_its_view_of_rank_zeros_lags"),
    Bug("a transient API error not retried within the call", "operator/api_policy.py",
        "if attempt + 1 == backoff.attempts:", "if True:",
        "tests/unit/test_api_policy.py::test_transient_errors_are_retried_within_the_call_and_counted_by_verb_kind_and_code"),
    Bug("Retry-After ignored", "tandem/api_errors.py",
        "return max(jittered, retry_after or 0.0)", "return jittered",
        "tests/unit/test_api_policy.py::test_delays_are_jittered_exponential_capped_and_honour_retry_after"),
    Bug("a pass an API failure ended left to kopf's backoff", "operator/daemon.py",
        "except Unavailable as error:", "except NotImplementedError as error:",
        "tests/unit/test_api_policy.py::"
        "test_the_loop_decides_a_failed_pass_again_within_seconds_and_a_clean_pass_clears_a_refusal"),
    Bug("keepLast never prunes", "worker/checkpoint.py",
        "pruned = checkpoint_owner.run_files(directory)[:-keep_last]", "pruned = []",
        "tests/integration/test_trainer.py::test_keep_last_prunes_the_trainers_older_checkpoints"),
    Bug("a pod's ranks numbered from its index, not index x ranksPerPod", "tandem/contract.py",
        "RANK: str(group_rank * local_world_size)", "RANK: str(group_rank)",
        "tests/unit/test_contract.py::test_a_pod_of_several_ranks_gives_each_its_rank_and_local_rank"),
    Bug("a rank that only lost its peer named as the group's cause", "operator/training.py",
        "elif self._cause_on_its_way():", "elif False:",
        "tests/unit/test_training_reconcile.py::test_reconcile"),
    Bug("an evicted Workload's quota given back while its ranks still run", "operator/training_queue.py",
        "if admission.evicted and not self.pods and admission.holds_quota:",
        "if admission.evicted and admission.holds_quota:",
        "tests/unit/test_queueing.py::test_reconcile_under_a_queue"),
    Bug("a preempted group killed without its grace period (no checkpoint at the agreed step)",
        "operator/training.py", "            self.result.stop_first = True\n            self.result.requeue_after = "
        "WAIT_SECONDS\n", "            self.result.stop_first = self.result.kill_at_once = True\n"
        "            self.result.requeue_after = WAIT_SECONDS\n",
        "tests/unit/test_queueing.py::test_reconcile_under_a_queue"),
    Bug("each worker on one device given its own copy of the model", "worker/serve/replicas.py",
        "return [copies[device] for device in devices]", "return [copy.deepcopy(copies[device]) for device in devices]",
        "tests/unit/test_inference.py::test_workers_on_one_device_share_one_frozen_copy_of_the_model"),
    Bug("a handed-over gRPC call with grpc-timeout 0 started anyway", "worker/serve/grpc_server.py",
        "            if seconds <= 0:\n", "            if False:\n",
        "tests/unit/test_grpc_wire.py::test_a_call_refused_before_its_handler_runs"),
    Bug("gRPC connections left open however long they idle", "worker/serve/grpc_server.py",
        "idle_ms = max(1, round(limits.idle_timeout_s * 1000))", "idle_ms = 1 << 30",
        "tests/integration/test_grpc_server.py::"
        "test_an_idle_connection_is_closed_with_goaway_and_others_are_served"),
    Bug("the C front's adopted connections left blocking (a client that stops reading stalls every other)",
        "worker/serve/_front.c", "fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0", "0",
        "tests/integration/test_abuse.py::test_a_client_that_pipelines_without_reading_does_not_starve_the_others"),
    Bug("a head ended by a CR alone taken by the C front (llhttp 8 reads it one way, the Python server another)",
        "worker/serve/_front_parse.c", "if (head > spec->max_head || !crlf_only(in, head))",
        "if (head > spec->max_head)",
        "tests/integration/test_abuse.py::test_what_the_rfcs_refuse_is_refused"),
    Bug("the C front's JSON parser taking an FP32 value float32 cannot hold", "worker/serve/_front_parse.c",
        "if (!isfinite(*value)) return 0;", "if (isnan(*value)) return 0;",
        "tests/integration/test_abuse.py::test_what_the_rfcs_refuse_is_refused"),
    Bug("a gRPC call its client cancels left queued until its deadline", "worker/serve/grpc_service.py",
        "        if answered.cancelled() and self.on_abort is not None:\n            self.on_abort()\n",
        "        pass\n",
        "tests/integration/test_grpc.py::test_a_call_its_client_cancels_leaves_the_queue_then_not_at_its_deadline"),
    Bug("a batching change one server process refuses left in the others", "worker/serve/app.py",
        "await asyncio.gather(*(change(previous) for change in changed), return_exceptions=True)",
        "await asyncio.gather(return_exceptions=True)",
        "tests/integration/test_server_group.py::test_a_batching_change_one_process_refuses_is_undone_in_the_others"),
    Bug("statistics of the answering server process alone", "worker/serve/routes.py",
        'stats = merge_states(await self._states())["stats"]',
        'stats = merge_states((await self._states())[:1])["stats"]',
        "tests/integration/test_server_group.py::test_statistics_metrics_and_readiness_count_every_process"),
    Bug("every server process of a pod follows the job on its own", "worker/serve/served_model.py",
        "and location.follow and (self.peers is None or self.peers.group.leader):", "and location.follow:",
        "tests/integration/test_server_group.py::test_the_leader_follows_the_job_for_the_group"),
    Bug("a group swap switching the processes that prepared when another failed", "worker/serve/served_model.py",
        "if any(outcome is not None for outcome in outcomes):", "if False:",
        "tests/integration/test_server_group.py::test_a_swap_one_process_cannot_prepare_switches_none"),
    Bug("a server process joining its group keeps weights of its own", "worker/serve/served_model.py",
        "await self.peers.weights.map(self.inference.replicas, weights)", "pass",
        "tests/integration/test_server_group.py::test_the_processes_serve_the_leaders_weights_from_one_file"),
    Bug("replicas built for new batch sizes not mapped to the shared weights", "worker/serve/served_model.py",
        "if self.peers is not None:  # new batch sizes bring new replicas: map them again",
        "if False:",
        "tests/integration/test_server_group.py::test_the_processes_serve_the_leaders_weights_from_one_file"),
    Bug("a skipped candidate reported by the leader alone", "worker/serve/served_model.py",
        "for peer in self.peers.others), return_exceptions=True):", "for peer in []), return_exceptions=True):",
        "tests/integration/test_server_group.py::test_the_leader_follows_the_job_for_the_group"),
    Bug("a server process that dies leaves the others serving", "worker/serve/processes.py",
        "            signal_all(signal.SIGTERM)\n        codes", "            pass\n        codes",
        "tests/integration/test_serve_processes.py::"
        "test_a_process_that_ends_on_its_own_stops_the_group_and_the_supervisor_exits_1[killed]"),
    Bug("a server process that stopped alone counted as a clean stop", "worker/serve/processes.py",
        "return 1 if failed or any(codes) else 0", "return 1 if any(codes) else 0",
        "tests/integration/test_serve_processes.py::"
        "test_a_process_that_ends_on_its_own_stops_the_group_and_the_supervisor_exits_1[stopped-alone]"),
    Bug("a killed supervisor's server processes left serving", "worker/serve/processes.py",
        "    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)\n", "",
        "tests/integration/test_serve_processes.py::test_a_supervisor_killed_outright_leaves_no_process_serving"),
    Bug("a group's processes each take the cores as if alone", "worker/serve/app.py",
        "share_cores(self.spec.workers_per_replica * (1 if self.group is None else self.group.size))",
        "share_cores(self.spec.workers_per_replica)",
        "tests/integration/test_serve_processes.py::test_the_cores_are_shared_by_every_replica_of_the_group"),
    Bug("a failure of any but the first of a pass's concurrent calls swallowed (the pass looks clean)",
        "operator/daemon.py", "    for result in results:\n        if isinstance(result, BaseException):",
        "    for result in results[:1]:\n        if isinstance(result, BaseException):",
        "tests/unit/test_apply.py::test_a_failed_call_ends_the_pass_only_once_the_calls_sent_beside_it_are_settled"),
    Bug("the server's Retry-After dropped between the call and the next pass", "operator/api_policy.py",
        "raise Unavailable(verb, kind, target, code, reason, message, retry_after)",
        "raise Unavailable(verb, kind, target, code, reason, message)",
        "tests/unit/test_api_policy.py::test_the_servers_retry_after_travels_from_the_failed_call_to_the_next_pass"),
    Bug("a pod's termination message keeps the head of a long log, not its end", "worker/train/launch.py",
        'tail = log_tail.encode()[-room:].decode(errors="ignore")',
        'tail = log_tail.encode()[:room].decode(errors="ignore")',
        "tests/integration/test_ranks_per_pod.py::"
        "test_the_termination_message_of_a_long_log_keeps_its_end_within_4096_bytes"),
    Bug("ranks started on quota Kueue reserved before its admission checks are ready", "operator/queueing.py",
        'admitted = holds_quota and true("Admitted") is not None and evicted is None',
        "admitted = holds_quota and evicted is None",
        "tests/unit/test_queueing.py::test_reconcile_under_a_queue"),
    Bug("keepLast and latest counting another run's checkpoints in the directory", "worker/checkpoint_owner.py",
        "    if record is None:\n        return step_files(directory)\n",
        "    return step_files(directory)\n",
        "tests/unit/test_checkpoint_ownership.py::test_keep_last_and_latest_count_only_the_runs_own_checkpoints"),
    Bug("a live holder's lease taken over by a second writer", "worker/checkpoint_owner.py",
        "    return (at - held.renewed).total_seconds() <= LEASE_STALE_SECONDS\n",
        "    return False\n",
        "tests/unit/test_checkpoint_ownership.py::test_who_may_take_the_lease"),
    Bug("a model or data the pre-flight found invalid restarted until backoffLimit", "tandem/restart_policy.py",
        "    if permanent is not None:\n", "    if False:\n",
        "tests/unit/test_preflight.py::test_a_permanent_failure_fails_at_once_spending_no_restart"),
    Bug("the leader's write check made before its connection is (a pause while connecting lets a write through)",
        "operator/leadership.py",
        "        if self.sock is None:  # type: ignore[attr-defined]\n"
        "            self.connect()  # type: ignore[attr-defined]\n        current.check(*self._request)\n",
        "        current.check(*self._request)\n        if self.sock is None:  # type: ignore[attr-defined]\n"
        "            self.connect()  # type: ignore[attr-defined]\n",
        "tests/unit/test_election.py::test_a_pause_while_connecting_is_caught_by_the_check_made_once_connected"),
    Bug("a status key the operator dropped kept (a merge patch keeps what it does not name)", "operator/daemon.py",
        "merge_patch(current.get(key), value) if key in OWN_FIELDS else value", "value",
        "tests/integration/test_operator_calls.py::"
        "test_a_status_key_the_operator_drops_is_deleted_and_rank_0s_part_of_a_shared_field_kept"),
    Bug("rank 0's keys deleted by the operator's patch of a field both write (recoveries, progress)",
        "operator/daemon.py",
        "merge_patch(current.get(key), value) if key in OWN_FIELDS else value",
        "merge_patch(current.get(key), value)",
        "tests/integration/test_operator_calls.py::"
        "test_a_status_key_the_operator_drops_is_deleted_and_rank_0s_part_of_a_shared_field_kept"),
    Bug("a status already written patched again on each pass (its nulls, rank 0's part of recoveries)",
        "operator/daemon.py",
        "if without_nulls(merge_patched(current.get(key), patch)) != without_nulls(current.get(key))",
        "if without_nulls(patch) != current.get(key)",
        "tests/integration/test_operator_calls.py::"
        "test_a_status_key_the_operator_drops_is_deleted_and_rank_0s_part_of_a_shared_field_kept"),
    Bug("a second lender lends for the replica a first loan in flight pays for", "operator/lending.py",
        '"baseReplicas": max(0, pool.pods - pool.short, pool.covered),',
        '"baseReplicas": max(0, pool.pods - pool.short),',
        "tests/unit/test_lending_trade.py::"
        "test_a_second_lender_does_not_lend_for_the_replica_a_first_loan_in_flight_pays_for"),
    Bug("a job's loan decided but not yet in the API unseen by the next job's pass", "operator/handlers.py",
        'memo.loans[key] = plan.status.get("lent")', 'memo.loans[key] = None',
        "tests/integration/test_lending.py::test_two_jobs_woken_by_one_short_replica_lend_one_worker_between_them"),
    Bug("a failed rank's log tail read before its last output was copied from its pipe", "worker/local_group.py",
        "if index in self._copiers and self.processes[index].poll() is not None:", "if False:",
        "tests/integration/test_local_group.py::"
        "test_the_tail_of_a_failed_ranks_log_holds_what_it_wrote_last_however_late_its_output_is_copied"),
]


def scratch_copy() -> Path:
    """The committed tree plus the working tree's changes, without .venv or caches."""
    target = Path(tempfile.mkdtemp(prefix="tandem-mutant-"))
    ignore = shutil.ignore_patterns(".venv", ".git", "__pycache__", "runs", "*.egg-info", ".pytest_cache")
    shutil.copytree(ROOT, target, dirs_exist_ok=True, ignore=ignore)
    return target


def check(bug: Bug) -> str:
    copy = scratch_copy()
    try:
        path = copy / bug.path
        text = path.read_text()
        if text.count(bug.old) != 1:
            return "NOT APPLIED (the code moved)"
        path.write_text(text.replace(bug.old, bug.new))
        if bug.path.endswith(".c"):  # the C front, built again in the copy
            built = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "--force"],
                                   cwd=copy, capture_output=True, text=True)
            if built.returncode:
                return f"NOT RUN (the mutant does not build: {built.stderr[-300:]})"
        # The copy's tandem and tests come first on the path, ahead of the editable install of this checkout.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), str(copy / "tests")])}
        probe = subprocess.run([sys.executable, "-c", "import tandem.worker, sys; print(tandem.worker.__file__)"],
                               env=env, cwd=copy, capture_output=True, text=True)
        if not probe.stdout.startswith(str(copy)):
            return f"NOT RUN (tandem.worker came from {probe.stdout.strip() or probe.stderr})"
        try:
            result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", bug.test],
                                    env=env, cwd=copy, capture_output=True, text=True, timeout=HUNG_SECONDS)
        except subprocess.TimeoutExpired:
            return f"caught, by a hang: the test did not end within {HUNG_SECONDS} s (CI would time out)"
        if result.returncode == 0:
            return "MISSED (the test passed)"
        failure = next((line for line in result.stdout.splitlines() if line.startswith("E ")), "").strip()
        return f"caught: {failure[:150]}"
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def main(selector: str = "") -> int:
    missed = 0
    for bug in BUGS:
        if selector in bug.name:
            verdict = check(bug)
            missed += not verdict.startswith("caught")
            print(f"{bug.name}: {verdict}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
