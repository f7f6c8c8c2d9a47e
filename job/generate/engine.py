"""The stage-1 engine actor: one vLLM engine (one GPU or one TP group), kept full.

Ray Data calls `CompletionGenerator.__call__` with one work unit (a row range of one input file). Each call
reads its rows, renders and tokenizes them with the model's own tokenizer, submits its rows to the engine
through an admission gate, and writes the unit's shard when its last row is done. The actor holds many units
at once (`units_in_flight_per_engine`); the gate keeps `max_rows_in_flight` requests in the engine (a full batch
plus a full queue), admitting rows in arrival order. So the engine stays full while units wait for their
slowest rows, rows stream out as they finish, and there is no separate tokenize/detokenize actor pool
(ray.data.llm's extra pools cost 1.5× plain vLLM's wall time on this 2-core machine, docs/BENCHMARKS.md).

Failure handling (the actor is replaced by Ray and its in-flight units retried; each unit's shard name is
deterministic, so a retried unit overwrites nothing that another unit wrote):
- vLLM's EngineDeadError kills the actor process: a dead engine is never retried in place.
- A watchdog kills the actor when the engine has requests in flight and finishes none for `hang_timeout_s` (0: no
  watchdog).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import socket
import time
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from job import layout, pipeline, scan, schema, storage
from job.cluster import model_missing_here, report_arrival, report_ready
from job.config import RunConfig, from_dict
from job.generate import engine_sizing, inputs, length_mix, prompts, quality
from job.generate.engine_start import (
    EngineStartError,
    is_gpu_platform,
    known_engine_problem,
    log_offsets,
    logged_since,
    reason_logged_since,
    resolved_sampling,
    why_engine_failed,
)

log = logging.getLogger("job.generate.engine")


def watchdog_interval(hang_timeout_s: float) -> float | None:
    """How often the hang watchdog looks, or None when there is none (`hang_timeout_s: 0`). Every 5 s, or a quarter
    of a shorter timeout. (0 used to mean a watchdog that looked without pause and found every engine hung.)"""
    if not hang_timeout_s or hang_timeout_s <= 0:
        return None
    return min(5.0, hang_timeout_s / 4)


# Per-unit attempt counts of the running job: <output>/attempts/<shard stem>.json, deleted when the shard is written.


def _error_result(row_id: str, error: str) -> dict[str, Any]:
    """The completion row of an input row that was not generated: its id and why."""
    result: dict[str, Any] = {c: None for c in schema.COMPLETION_COLUMNS}
    result.update({schema.ID: row_id, schema.ERROR: error})
    return result


def _decode_rows(table: pa.Table) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """The unit's rows as dicts, and {row index: error} for rows whose strings are not valid UTF-8 (parquet stores
    such bytes without complaint; decoding them fails). One bad row must not fail its unit on every rerun."""
    try:
        return table.to_pylist(), {}
    except UnicodeDecodeError:
        pass
    rows, bad = [], {}
    ids = table.column(schema.ID).cast(pa.binary()) if pa.types.is_string(table.schema.field(schema.ID).type) \
        else table.column(schema.ID)
    for i in range(table.num_rows):
        try:
            rows.append(table.slice(i, 1).to_pylist()[0])
        except UnicodeDecodeError as e:
            row_id = ids[i].as_py()
            rows.append({schema.ID: row_id.decode(errors="replace") if isinstance(row_id, bytes) else row_id})
            bad[i] = f"input is not valid UTF-8 ({e.reason}: byte {e.object[e.start:e.start + 1]!r})"
    return rows, bad


@dataclasses.dataclass(frozen=True)
class RowSettings:
    """How a row is sampled: vLLM's sampling keyword arguments, thinking on or off (rendered into the template), and
    the generation prompt that template ends with (quality's template check). The run's, or one of
    `generate.sampling_variants` (the row's `variant`)."""
    sampling: dict
    thinking: bool
    generation_prompt: list[int]


class CompletionGenerator:
    def __init__(self, config: dict, carried_schema_bytes: bytes, chat_template: str | None, job_token: str,
                 fence, census=None, lengths: dict | None = None):
        """`fence`: the stage's writer lock (job/lock.py), through which every write of this actor commits.
        `census`: the stage's census book (job/cluster.py), told once the engine has started. `lengths`: the run's
        measured length mix so far (run.json's `generate.lengths`), which `max_num_seqs: auto` sizes for."""
        import ray  # heavy: imported on use

        # First: the secrets among env_vars, which never went through Ray's runtime_env (Ray logs those), set in
        # this process only; and everything this actor prints redacted.
        pipeline.apply_secrets(config)
        report_arrival(census)  # the stage can count and stop this actor from now on

        # Before the heavy imports: a node without the model fails in seconds. `load_format: dummy` (benchmarks)
        # needs no weight files.
        dummy = config.get("engine_kwargs", {}).get("load_format") == "dummy"
        # `generate.regenerate: none` keeps the data's own turns: the tokenizer only, no engine, no weights.
        self.keep_data = config.get("generate", {}).get("regenerate") == prompts.NONE
        missing = model_missing_here(config["model"], needs_weights=not dummy and not self.keep_data)
        if missing:
            raise EngineStartError(missing)
        self.node_id = ray.get_runtime_context().get_node_id()

        from transformers import AutoTokenizer  # heavy: imported on use
        from vllm import AsyncEngineArgs, SamplingParams  # heavy: imported on use
        from vllm.sampling_params import RequestOutputKind  # heavy: imported on use
        from vllm.v1.engine.async_llm import AsyncLLM  # heavy: imported on use

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        self.config: RunConfig = from_dict(config)
        self.carried_schema = pa.ipc.read_schema(pa.py_buffer(carried_schema_bytes))
        self.out_schema = schema.completion_schema(self.carried_schema)
        self.chat_template = chat_template
        self.lengths = lengths
        self.job_token = job_token  # attempts of a unit are counted per job: a new job retries every unit afresh
        self.fence = fence  # the driver's writer lock (job/lock.py): every write of this actor commits through it
        gen = self.config.generate
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        except Exception as e:  # the model's files or the hub: the same on every retry
            first = (str(e).strip().splitlines() or [""])[0]
            raise EngineStartError(f"the tokenizer of model {self.config.model} could not be loaded on "
                                   f"{socket.gethostname()}: {type(e).__name__}: {first}") from None
        self.base = RowSettings({}, gen.enable_thinking, quality.generation_prompt_ids(
            self.tokenizer, enable_thinking=gen.enable_thinking, chat_template_kwargs=gen.chat_template_kwargs))
        self.variants: list[RowSettings] = []  # generate.sampling_variants, made when the engine has started
        self.think_end_id = self.tokenizer.convert_tokens_to_ids("</think>")
        if self.think_end_id == self.tokenizer.unk_token_id:
            self.think_end_id = None
        self.special_ids = set(self.tokenizer.all_special_ids) | {
            i for i in (self.think_end_id, self.tokenizer.convert_tokens_to_ids("<think>")) if i is not None}
        # Watchdog state: requests in flight and the last time one finished.
        self.num_in_flight = 0
        self.last_progress = time.monotonic()
        self.watchdog: asyncio.Task | None = None
        self.gate: asyncio.Semaphore | None = None  # created in the event loop that runs the calls
        self.use_seed = False
        if self.keep_data:
            self.engine, self.max_model_len = None, None
            self.device, self.max_num_seqs, self.sizing_line, self.sizing_holds = "", 0, "", 0
            self.max_rows_in_flight = gen.max_rows_in_flight or 256  # no engine to keep full: any number will do
        else:
            self._start(gen, AsyncLLM, AsyncEngineArgs, SamplingParams, RequestOutputKind)
        report_ready(census)

    def _start(self, gen, AsyncLLM, AsyncEngineArgs, SamplingParams, RequestOutputKind) -> None:
        problem = known_engine_problem(self.config.model, self.config.engine_kwargs,
                                       resolved_sampling(self.config.model, gen.sampling), on_gpu=is_gpu_platform(),
                                       per_request_seed=gen.per_request_seed)
        if problem:
            raise EngineStartError(problem)
        engine_kwargs, sizing = dict(self.config.engine_kwargs), None
        if engine_sizing.is_auto(engine_kwargs):  # sized from this device's memory before the engine exists
            try:
                tokens, source = length_mix.run_sizing_tokens(self.config, self.lengths)
                sizing = engine_sizing.auto_max_num_seqs(self.config.model, engine_kwargs, tokens, source=source)
            except ValueError as e:
                raise EngineStartError(str(e)) from None
            engine_kwargs["max_num_seqs"] = sizing.max_num_seqs
            log.info("%s", sizing.why)
        started = time.monotonic()
        log_from = log_offsets()
        self.engine = self._start_engine(AsyncLLM, AsyncEngineArgs(model=self.config.model, **engine_kwargs), log_from)
        log.info("engine ready in %.1f s (pid %d)", time.monotonic() - started, os.getpid())
        self.sizing_line, self.sizing_holds = "", 0
        if sizing is not None:  # vLLM's own figures, now that it has laid out its cache
            line, self.sizing_holds = engine_sizing.check_against_vllm(
                sizing, self.engine.vllm_config.cache_config.num_gpu_blocks, logged_since(log_from))
            fits = self.sizing_holds >= sizing.max_num_seqs
            self.sizing_line = line + f"; sized for {source}" + ("" if fits else (
                f": vLLM's pool is smaller than the sums assumed, so full batches will preempt; set "
                f"engine_kwargs.max_num_seqs to {self.sizing_holds} or fewer"))
            (log.info if fits else log.warning)("%s", self.sizing_line)
        # When the stage is done Ray ends this actor, and its EngineCore process may stop before the engine's client
        # here does: vLLM then logs "AsyncLLM output_handler failed" with an EngineDeadError traceback, which after a
        # run that succeeded reads as a failure (2 of 14 small runs; every run once the worker ran in-process). An
        # engine that dies while it holds no request of ours loses nothing (the next request would find it dead and
        # end this actor, engine.py's rule): that traceback is dropped; one that dies mid-work is still logged.
        logging.getLogger("vllm.v1.engine.async_llm").addFilter(
            lambda record: getattr(self, "num_in_flight", 0) > 0
            or not record.getMessage().startswith("AsyncLLM output_handler"))
        self.max_model_len = self.engine.model_config.max_model_len
        self.max_num_seqs = self.engine.vllm_config.scheduler_config.max_num_seqs
        self.max_rows_in_flight = gen.max_rows_in_flight or 2 * self.max_num_seqs
        self.device = engine_sizing.device_name()

        sampling = resolved_sampling(self.config.model, gen.sampling)
        # We split and decode the output ourselves once at the end; vLLM's incremental detokenizer would decode
        # every step. FINAL_ONLY: one message per request instead of one per generated token.
        sampling.setdefault("detokenize", False)
        sampling["output_kind"] = RequestOutputKind.FINAL_ONLY
        self.base = dataclasses.replace(self.base, sampling=sampling)
        self.variants = [self._variant(i, v, SamplingParams) for i, v in enumerate(gen.sampling_variants)]
        self.SamplingParams = SamplingParams
        self.use_seed = gen.per_request_seed

    def _variant(self, index: int, variant: dict, SamplingParams) -> RowSettings:
        """One of generate.sampling_variants over the run's settings; a key vLLM does not know ends the job naming it
        (the config checked the rest when it was read)."""
        thinking = variant.get("enable_thinking", self.base.thinking)
        sampling = {**self.base.sampling, **{k: v for k, v in variant.items() if k != "enable_thinking"}}
        try:
            SamplingParams(**sampling)
        except Exception as e:  # TypeError (unknown key) or vLLM's ValueError (a value out of range)
            raise EngineStartError(f"config: generate.sampling_variants[{index}] is not a valid set of vLLM "
                                   f"sampling settings: {type(e).__name__}: {e}") from None
        prompt = self.base.generation_prompt if thinking == self.base.thinking else quality.generation_prompt_ids(
            self.tokenizer, enable_thinking=thinking, chat_template_kwargs=self.config.generate.chat_template_kwargs)
        return RowSettings(sampling, thinking, prompt)

    def _start_engine(self, AsyncLLM, engine_args, log_from: dict[int, int]):
        """Start the engine, giving up after `generate.engine_start_timeout_s`: an engine that hangs while starting
        (a compile that never ends, NCCL waiting for a peer, a bad GPU) otherwise stalls the job without a word.
        The start runs in a helper thread so this one can stop waiting; the actor then fails, which ends the job
        once with the message (its processes go with it)."""

        timeout = self.config.generate.engine_start_timeout_s
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-start")
        future = pool.submit(AsyncLLM.from_engine_args, engine_args)
        pool.shutdown(wait=False)
        try:
            return future.result(timeout=timeout if timeout and timeout > 0 else None)
        except concurrent.futures.TimeoutError:
            raise EngineStartError(
                f"the vLLM engine for model {self.config.model} did not start within {timeout:.0f} s "
                f"(generate.engine_start_timeout_s) on {socket.gethostname()}: a start that hangs (compile, NCCL, a "
                "bad GPU) or one slower than that limit. Look at the actor's log for where it stopped; raise the "
                "limit if starts are just slow.") from None
        except Exception as e:  # the config, the model files or the install: the same on every retry
            raise EngineStartError(f"vLLM could not start an engine for model {self.config.model}: "
                                   f"{why_engine_failed(self.config.model, e, reason_logged_since(log_from))}"
                                   ) from None

    # -----------------------------------------------------------------------------------------------------------
    async def __call__(self, batch: dict[str, Any]):
        if self.watchdog is None:
            self.watchdog = asyncio.get_running_loop().create_task(self._watch())
            self.gate = asyncio.Semaphore(self.max_rows_in_flight)
        for i in range(len(batch["file_uri"])):
            unit = layout.CompletionUnit.from_row({key: column[i] for key, column in batch.items()})
            yield await self._run_unit(unit)

    async def _run_unit(self, unit: layout.CompletionUnit) -> dict[str, list]:
        started = time.monotonic()
        # A job whose lock was taken over starts no more work (and commits none: every write goes through the fence).
        await asyncio.to_thread(self.fence.check)
        table = await asyncio.to_thread(inputs.read_unit, unit, self.config.storage, self.carried_schema)
        rows, undecodable = _decode_rows(table)
        attempts = await asyncio.to_thread(self._count_attempt, unit)
        limit = self.config.generate.max_unit_attempts
        if limit and attempts > limit:  # a poison unit: its actor died every time; the run goes on without it
            log.error("unit %s failed %d times in this job: writing its rows as errors", unit.shard_name, limit)
            for i in range(len(rows)):
                undecodable.setdefault(i, f"unit failed {limit} times: its engine actor died or hung every time "
                                          "(out of memory, an engine crash, a hang); not generated. Delete this "
                                          "shard and rerun to try again")
        # One input row → one output row per turn to generate (generate.regenerate); `source` maps them back. Each
        # job yields a list of rows: one, or a conversation's turns (`conversation`: generated one after the other,
        # while the other conversations' turns keep the engine full).
        jobs, source = [], []
        gen = self.config.generate
        mode = gen.regenerate
        for i, row in enumerate(rows):
            if i in undecodable:
                jobs.append(self._error_row(row, undecodable[i]))
                source.append(i)
                continue
            try:
                messages = prompts.row_messages(row)
                tools = prompts.row_tools(row)
                targets = prompts.regeneration_targets(str(row[schema.ID]), messages, mode)
                # One variant per input row: a conversation's turns are sampled alike, as one served session is.
                variant = prompts.variant_index(gen.seed, str(row[schema.ID]), len(self.variants)) \
                    if self.variants else None
            except prompts.RowError as e:  # a bad conversation: one error row under the row's own id
                jobs.append(self._error_row(row, str(e)))
                source.append(i)
                continue
            if mode == prompts.CONVERSATION:
                jobs.append(self._run_conversation(targets, tools, variant))
                source += [i] * len(targets)
                continue
            for turn in targets:
                jobs.append(self._one(self._run_row(turn, tools, variant)))
                source.append(i)
        results = [r for rows_of_job in await asyncio.gather(*jobs) for r in rows_of_job]
        if undecodable:  # their carried values are not valid UTF-8 either: nulls, so every reader can read the shard
            mask = pa.array([i in undecodable for i in range(table.num_rows)])
            table = pa.table({name: pc.if_else(mask, pa.nulls(table.num_rows, col.type), col) if name != schema.ID
                              else col for name, col in zip(table.column_names, table.columns)})
        if source != list(range(table.num_rows)):  # carried columns repeated for each turn of a conversation
            table = table.take(pa.array(source, pa.int64()))
        out = self._to_table(table, results)
        uri = storage.join(self.config.output, layout.COMPLETIONS_DIR, unit.shard_name)
        await asyncio.to_thread(self.fence.write_shard, uri, out)
        await asyncio.to_thread(self._forget_attempts, unit)
        return {
            "shard": [unit.shard_name],
            "num_rows": [len(rows)],  # input rows: progress and --limit count these
            "num_outputs": [len(results)],  # output rows: one per generated turn (generate.regenerate)
            "num_errors": [sum(r[schema.ERROR] is not None for r in results)],
            "num_prompt_tokens": [sum(r[schema.NUM_PROMPT_TOKENS] or 0 for r in results)],
            "num_output_tokens": [sum(r[schema.NUM_OUTPUT_TOKENS] or 0 for r in results)],
            **{f"lengths_{k}": [v] for k, v in length_mix.row_lengths(  # the run's measured mix (length_mix.py)
                [r[schema.NUM_PROMPT_TOKENS] or 0 for r in results if r[schema.ERROR] is None],
                [r[schema.NUM_OUTPUT_TOKENS] or 0 for r in results if r[schema.ERROR] is None]).items()},
            **{f"num_{flag}": [sum(bool(r[flag]) for r in results)] for flag in schema.QUALITY_FLAGS},
            "seconds": [time.monotonic() - started],
            "node": [self.node_id],
            "device": [self.device],  # the device type and the max_num_seqs its engine runs with (`auto` differs)
            "max_num_seqs": [self.max_num_seqs],
            "sizing": [self.sizing_line],  # `auto`: the sums beside vLLM's own figures
            "sizing_holds": [self.sizing_holds],  # sequences of the sized length vLLM's pool holds (0: not auto)
        }

    def _attempts_uri(self, unit: layout.CompletionUnit) -> str:
        return storage.join(self.config.output, layout.attempts_name(unit))

    def _count_attempt(self, unit: layout.CompletionUnit) -> int:
        """This unit's attempt number in this job, counted in the run directory (an actor that dies forgets)."""
        uri = self._attempts_uri(unit)
        try:
            seen = storage.read_json(uri, self.config.storage)
        except FileNotFoundError:  # the unit's first attempt in any job since its last shard
            seen = {}
        attempt = seen.get("attempts", 0) + 1 if seen.get("job") == self.job_token else 1
        self.fence.write_json(uri, {"job": self.job_token, "attempts": attempt})
        return attempt

    def _forget_attempts(self, unit: layout.CompletionUnit) -> None:
        try:
            self.fence.delete(self._attempts_uri(unit))
        except (OSError, storage.StorageError):  # a fenced-out job's count is left to the job that holds the lock
            pass  # a stale count only matters to the job that wrote it

    async def _error_row(self, row: dict[str, Any], error: str) -> list[dict[str, Any]]:
        return [_error_result(str(row[schema.ID]), error)]

    @staticmethod
    async def _one(job) -> list[dict[str, Any]]:
        return [await job]

    async def _run_conversation(self, targets: list[prompts.Target], tools: list[dict] | None,
                                variant: int | None) -> list[dict]:
        """`generate.regenerate: conversation`: the conversation's turns one after the other, turn k on the data's
        history with the assistant turns before it replaced by the model's own answers (prompts.with_own_answers),
        rendered through the chat template like any prompt. Each turn takes its own place at the gate, so the engine
        runs other conversations' turns meanwhile. A turn that fails (its prompt too long for the context, a
        template error, a refused request) ends the conversation: the turns after it have no answer to follow and
        are row errors naming that turn; the turns before it are kept. The rows are returned together and written
        with the unit's shard: a conversation is never half in the output."""
        results, answers = [], []
        for target in targets:
            history = prompts.with_own_answers(target.history, answers)
            result = await self._run_row(dataclasses.replace(target, history=history), tools, variant)
            results.append(result)
            if result[schema.ERROR] is not None:
                why = f"not generated: turn {target.turn} of this conversation failed ({result[schema.ERROR]})"
                for later in targets[len(results):]:
                    results.append({**_error_result(later.id, why[:500]), schema.TURN: later.turn})
                break
            answers.append(prompts.own_answer(result[schema.REASONING], result[schema.ANSWER]))
        return results

    async def _run_row(self, target: prompts.Target, tools: list[dict] | None,
                       variant: int | None = None) -> dict[str, Any]:
        gen = self.config.generate
        row_id = target.id
        settings = self.base if variant is None else self.variants[variant]
        result: dict[str, Any] = {c: None for c in schema.COMPLETION_COLUMNS}
        result[schema.ID] = row_id
        result[schema.VARIANT] = variant
        template = dict(chat_template=self.chat_template, enable_thinking=settings.thinking,
                        chat_template_kwargs=gen.chat_template_kwargs, tools=tools)
        try:
            if self.keep_data:
                prompt_ids, output_ids = prompts.data_turn_ids(self.tokenizer, target, **template)
            else:
                prompt_ids = prompts.render_prompt_ids(self.tokenizer, target.history, **template)
            if self.max_model_len is not None and len(prompt_ids) >= self.max_model_len:
                raise prompts.RowError(f"prompt too long: {len(prompt_ids)} tokens, the model allows "
                                       f"{self.max_model_len - 1} (max_model_len {self.max_model_len})")
        except prompts.RowError as e:
            result[schema.ERROR] = str(e)
            return result
        except Exception as e:  # a template that raises on this row (e.g. Jinja's raise_exception)
            result[schema.ERROR] = f"chat template failed: {type(e).__name__}: {e}"
            return result
        result[schema.TURN] = target.turn
        if target.original is not None:
            result[schema.ORIGINAL_TURN_TOKENS] = len(self.tokenizer(prompts.original_turn_text(target.original),
                                                                     add_special_tokens=False)["input_ids"])
        if self.keep_data:  # the data's own turn: nothing to generate
            return self._completed(result, prompt_ids, output_ids, "data", None, settings)

        seed = prompts.row_seed(gen.seed, row_id)
        params = self.SamplingParams(**settings.sampling, **({"seed": seed} if self.use_seed else {}))
        async with self.gate:
            try:
                return await self._generate(result, prompt_ids, params, seed, settings)
            except Exception as e:  # one request vLLM refuses, or output we cannot split: this row, not the job
                log.warning("row %s failed: %s: %s", row_id, type(e).__name__, e)
                return _error_result(row_id, f"generation failed: {type(e).__name__}: {e}"[:500])

    async def _generate(self, result: dict[str, Any], prompt_ids: list[int], params, seed: int,
                        settings: RowSettings) -> dict[str, Any]:
        from vllm.inputs import TokensPrompt  # heavy: imported on use
        from vllm.v1.engine.exceptions import EngineDeadError  # heavy: imported on use

        row_id = result[schema.ID]
        if self.num_in_flight == 0:  # the watchdog measures from the moment work arrives, not from idle time
            self.last_progress = time.monotonic()
        self.num_in_flight += 1
        try:
            final = None
            outputs = self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                           request_id=f"{row_id}-{uuid.uuid4().hex[:8]}")
            async for final in outputs:  # noqa: B007 (the last output is the one read after the loop)
                pass
        except EngineDeadError:
            log.error("vLLM engine died; exiting so Ray replaces this actor and retries its units")
            os._exit(1)
        finally:
            self.num_in_flight -= 1
            self.last_progress = time.monotonic()
        completion = final.outputs[0]
        return self._completed(result, prompt_ids, list(completion.token_ids), completion.finish_reason,
                               seed if self.use_seed else None, settings)

    def _completed(self, result: dict[str, Any], prompt_ids: list[int], output_ids: list[int],
                   finish_reason: str | None, seed: int | None, settings: RowSettings) -> dict[str, Any]:
        """The completion row: the token ids, their split at `</think>`, counts and quality flags."""
        # The data's own turn holds a think block only if it has one (it follows the template's prompt, not ours).
        thinking = settings.thinking and (not self.keep_data or self.think_end_id in output_ids)
        reasoning, answer, n_reasoning, n_answer, closed = prompts.split_completion(
            self.tokenizer, output_ids, self.think_end_id, thinking)
        result.update({
            schema.PROMPT_TOKEN_IDS: prompt_ids,
            schema.OUTPUT_TOKEN_IDS: output_ids,
            schema.REASONING: reasoning,
            schema.ANSWER: answer,
            schema.FINISH_REASON: finish_reason,
            schema.NUM_PROMPT_TOKENS: len(prompt_ids),
            schema.NUM_OUTPUT_TOKENS: len(output_ids),
            schema.NUM_REASONING_TOKENS: n_reasoning,
            schema.NUM_ANSWER_TOKENS: n_answer,
            schema.SEED: seed,
        })
        result.update(quality.row_flags(
            prompt_ids=prompt_ids, output_ids=output_ids, finish_reason=finish_reason,
            think_closed=closed, answer=answer, thinking=thinking,
            # A kept turn's prompt is the template's own rendering of the conversation: nothing to compare.
            expected_generation_prompt=[] if self.keep_data else settings.generation_prompt,
            special_ids=self.special_ids,
            config=self.config.quality))
        return result

    def _to_table(self, inp: pa.Table, results: list[dict]) -> pa.Table:
        columns = {name: [r[name] for r in results] for name in schema.COMPLETION_COLUMNS}
        arrays = [pa.array(columns[f.name], type=f.type) for f in schema.COMPLETION_FIELDS]
        arrays += [inp.column(name) for name, _ in schema.carried_columns(self.carried_schema)]
        table = pa.Table.from_arrays(arrays, schema=self.out_schema)
        # A fresh content id per commit: stage 2 knows its hidden states of a regenerated shard are stale.
        # Its counts in its footer (scan.shard_counts): `status` and stage 2's estimate read them with the footer (or
        # from the trust cache) instead of the shard's columns.
        return table.replace_schema_metadata({**(table.schema.metadata or {}), schema.META_SHARD_ID: uuid.uuid4().hex,
                                              schema.META_COUNTS: json.dumps(scan.shard_counts(table))})

    async def _watch(self):
        timeout = self.config.generate.hang_timeout_s
        interval = watchdog_interval(timeout)
        if interval is None:
            return  # hang_timeout_s: 0, no watchdog
        while True:
            await asyncio.sleep(interval)
            if self.num_in_flight and time.monotonic() - self.last_progress > timeout:
                log.error("engine hung: %d requests in flight, none finished for %.0f s; exiting so Ray replaces "
                          "this actor and retries its units", self.num_in_flight, timeout)
                os._exit(1)
