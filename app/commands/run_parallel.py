"""`mlight run` as one rank of `torchrun` (data parallel, tensor parallel inside) or of `--tensor-parallel K`.
Each phase ends with every rank agreeing it went well (coord.agree): one error line, from rank 0, one exit code.
Each replica's first rank keeps its own run file; rank 0 merges them into the output; a rerun resumes every rank."""

from __future__ import annotations

import contextlib
import io
import os
import time
from pathlib import Path

from app.commands.run import (_Counter, _ProgressLine, _Stopper, _load_engine, _manifest, _plan_batches, _read,
                              _refuse_rejects, _say, _say_other_parts, check_files, refuse_turns, resuming_line,
                              sampling)
from core.errors import MlightError, UsageError
from core.io.download import resolve_model
from core.io.prompts import PromptSet
from core.io.results import output_format
from core.io.runstore import RunStore, final_records, prepare_requests, run_pending
from core.io.shards import merge, part_name, shard_entries


def run(args, world) -> int:
    from core.runtime.distributed import coord
    from core.runtime.distributed.world import init, shutdown

    groups = init(world)
    lost = False
    try:
        return _Rank(args, world, groups).run()
    except coord.Quiet as q:
        return q.code
    except coord.RankLost:
        lost = True
        raise
    finally:
        if not lost:  # a group with a dead member cannot be torn down politely; the process exit does it
            shutdown()


class _Rank:
    def __init__(self, args, world, groups):
        self.args, self.world, self.groups = args, world, groups
        self.rank = world.rank
        self.out = Path(args.out)
        self.store: RunStore | None = None
        self.progress = _ProgressLine() if world.local_rank == 0 else (lambda ev: None)

    def phase(self, fn):
        """Run `fn` on this rank, then agree with every rank that nobody failed."""
        from core.runtime.distributed import coord

        err, value = None, None
        # one copy of what every rank would print (bad lines, progress) is enough
        quiet = contextlib.redirect_stderr(io.StringIO()) if self.rank != 0 else contextlib.nullcontext()
        try:
            with quiet:
                value = fn()
        except (Exception, KeyboardInterrupt) as e:  # handed to coord.agree, which re-raises it on rank 0
            err = e
        coord.agree(err, self.rank, self.groups.phase)
        return value

    def run(self) -> int:
        w = self.world
        stopper = _Stopper().install()
        try:
            prompts, model_dir, model_name = self.phase(self._inputs)
            self.phase(lambda: self._same_prompts(prompts))
            if w.tp_leader:
                self.store = RunStore(self.out, part=part_name(w.dp_rank, w.dp_size))
            self.phase(lambda: self._open_store(prompts, model_dir, model_name))
            engine, requests = self.phase(lambda: self._engine(prompts, model_dir))
            return self._generate(engine, prompts, requests, model_name, stopper)
        finally:
            stopper.restore()
            if self.store is not None:
                self.store.release()

    def _inputs(self):
        args, w = self.args, self.world
        check_files(args, self.out, ("several ranks cannot share stdin",
                                     "give the prompts as a file every rank can read"))
        import torch

        # the ranks of a node share its cores; torch would give each of them all of them
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // w.local_size))
        if w.tp_leader:
            RunStore(self.out, part=part_name(w.dp_rank, w.dp_size)).check_writable()
        prompts = _read(args, self.out)
        refuse_turns(prompts, "torchrun or --tensor-parallel")
        model_dir, model_name = resolve_model(args.model, args.revision, progress=self.progress)
        args.replicas_here = w.local_size // w.tp
        _plan_batches(args, prompts, model_dir)
        return prompts, model_dir, model_name

    def _gather(self, value, group=None) -> list:
        """`value` from every rank, in rank order."""
        import torch.distributed as dist

        out: list = [None] * self.world.size
        dist.all_gather_object(out, value, group=group)
        return out

    def _same_prompts(self, prompts: PromptSet) -> None:
        hashes = self._gather(prompts.sha256)
        odd = [r for r, h in enumerate(hashes) if h != hashes[0]]
        if odd:
            raise UsageError(f"rank {odd[0]} reads a different {self.args.prompts} than rank 0",
                             "give every node the same prompts file")

    def _open_store(self, prompts: PromptSet, model_dir: Path, model_name: str) -> None:
        if self.store is None:
            return
        w = self.world
        self.store.acquire()
        manifest = _manifest(self.args, prompts, model_dir, model_name)
        manifest["shard"] = {"replica": w.dp_rank, "replicas": w.dp_size, "tensor_parallel": w.tp}
        self.store.start(manifest, restart=self.args.restart)
        if self.rank == 0:
            _say_other_parts(self.out, w.dp_size)

    def _engine(self, prompts: PromptSet, model_dir: Path):
        args, w = self.args, self.world
        tp = None
        if w.tp > 1:
            from core.runtime.distributed.tensor_parallel import TensorParallel

            tp = TensorParallel(self.groups.tp, device="cuda" if self.groups.tp_backend == "nccl" else "cpu")
        engine = _load_engine(args, model_dir, self.progress, tp=tp)
        requests = prepare_requests(engine, prompts, sampling(args))
        _refuse_rejects(prompts, args.skip_bad, self.out)
        return engine, requests

    def _pending(self, mine: list) -> list[str]:
        """The ids this replica still has to run, decided by its first rank (which holds the run file)."""
        lists = self._gather([e.id for e in mine if e.id not in self.store.done] if self.store else None)
        return lists[self.world.tp_ranks()[0]]

    def _generate(self, engine, prompts: PromptSet, requests: dict, model_name: str, stopper: _Stopper) -> int:
        from core.runtime.distributed import coord

        args, w = self.args, self.world
        mine = shard_entries(prompts.entries, w.dp_rank, w.dp_size)
        pending = self._pending(mine)
        total, t0 = len(prompts.entries), time.perf_counter()
        self._say_resuming(total)
        status, error = "done", None
        stopper.generating = True
        try:
            if self.store is not None:
                part = PromptSet(prompts.source, prompts.format, prompts.sha256, entries=mine)
                counter = _Counter(len(mine)) if self.rank == 0 else None
                finished = run_pending(engine, part, self.store, requests, batch_size=args.batch,
                                       micro_batch_size=args.micro_batch, should_stop=lambda: stopper.requested,
                                       on_result=counter)
                if counter is not None:
                    counter.end()
                status = "done" if finished else "stopped"
            else:  # a tensor-parallel follower: the same steps as its group's first rank, nothing to save
                for _ in engine.generate([requests[i] for i in pending], batch_size=args.batch,
                                         micro_batch_size=args.micro_batch, should_stop=lambda: stopper.requested):
                    pass
        except KeyboardInterrupt:
            status = "stopped"
        except MlightError as e:
            # the group's other ranks may wait in a collective for this one: leave, unless they all agreed on it
            if w.tp > 1 and not getattr(e, "agreed", False):
                raise
            status, error = "error", str(e)
        finally:
            stopper.generating = False
            engine.close()
        if self.store is not None:
            self.store.close()
        mine_done = {e.id: self.store.done[e.id] for e in mine if e.id in self.store.done} if self.store else None
        report = {"status": status, "error": error, "records": mine_done, "total": len(mine),
                  "run_file": self.store.run_path.name if self.store else None}
        reports = coord.collect(report, self.rank)
        decision = self._merge(reports, prompts, model_name, total, t0) if self.rank == 0 else None
        try:
            decision = coord.broadcast(decision, self.rank, self.groups.phase)
        except RuntimeError:  # rank 0 is gone
            raise coord.Quiet(1) from None
        if decision == "merged" and self.store is not None and self.rank != 0:
            self.store.drop_run_file()
        return {"merged": 0, "stopped": 130}.get(decision, 1)

    def _say_resuming(self, total: int) -> None:
        counts = self._gather(len(self.store.done) if self.store and self.store.resumed else 0,
                              self.groups.phase.group)
        if sum(counts) and self.rank == 0:
            _say(resuming_line(sum(counts), total))

    def _merge(self, reports: list[dict], prompts: PromptSet, model_name: str, total: int, t0: float) -> str:
        """Rank 0: write the output when every replica finished; otherwise say what is left where."""
        leaders = [r for r in reports if r["run_file"] is not None]
        failed = [(rank, r) for rank, r in enumerate(reports) if r["status"] == "error"]
        if failed:
            rank, r = failed[0]
            _say(f"rank {rank} failed: {r['error']}")
        if any(r["status"] != "done" for r in reports):
            done = sum(len(r["records"]) for r in leaders)
            where = ", ".join(r["run_file"] for r in leaders)
            _say(f"{'stopped' if not failed else 'not finished'}: {done} of {total} requests done, saved in {where}; "
                 "rerun the same command to finish the rest")
            return "stopped" if not failed else "failed"
        done, missing = merge(prompts.entries, [r["records"] for r in leaders])
        if missing:
            raise MlightError(f"{len(missing)} requests are in no replica's results (first: {missing[0]})",
                              "rerun the same command; the run files are kept")
        records = final_records(prompts, done, model_name)
        self.store.finish(records, [r.to_dict() for r in prompts.rejects], output_format(self.out))
        tokens = sum(r["output_tokens"] for r in done.values())
        rej = f", {len(prompts.rejects)} rejected → {self.store.rejected_path.name}" if prompts.rejects else ""
        _say(f"{total} results in {self.out}{rej} ({self.world.dp_size} replica{'s' if self.world.dp_size > 1 else ''}"
             f" × {self.world.tp} rank{'s' if self.world.tp > 1 else ''}, {tokens:,} tokens in all, "
             f"{time.perf_counter() - t0:.1f} s)")
        return "merged"

