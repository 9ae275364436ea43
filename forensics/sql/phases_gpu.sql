-- depends: _phase_trace, _phase_setting, _phase_gpu_category, _phase_kineto_segments, phase_profiler_steps
--
-- Phase attribution, GPU side of PyTorch profiler traces: `phase_gpu_events`, `phase_gpu`,
-- `phase_gpu_steps`, `phase_collectives`.
--
-- * `phase_gpu_events`: GPU activity (kernels, memcpy, memset) with `is_nccl` (a NCCL
--   collective kernel; `name` is kept for those only) and `seconds`.
-- * `phase_gpu(file_id, rank, step, phase, sub_phase, kernel_s, nccl_s, events)`: GPU time of the
--   events launched while each phase was open (an event belongs to the phase open on its
--   CPU thread when it started): compute kernels and NCCL kernels apart. Phase `idle` =
--   kernels that started while no phase annotation was open.
-- * `phase_gpu_steps(file_id, rank, step, step_s, gpu_busy_s, gpu_idle_s, kernel_s, nccl_s)`: per
--   profiler step, the time the GPU had at least one event running (overlapping streams
--   counted once), the rest (`gpu_idle_s`), and the summed kernel time of the events that
--   started in the step.
-- * `phase_collectives(step, pg_name, coll_name, idx, rank, phase, sub_phase, start_us, seconds,
--   wait_s, late_s, start_late_s)`: each NCCL collective matched across ranks (the idx-th
--   kernel of that collective in that step and process group on every rank that ran
--   collectives in the step). A collective ends on all ranks together, so a rank that arrives
--   late runs a short kernel and the others wait: `wait_s` = this rank's kernel time minus the
--   shortest (time spent waiting for the last rank), `late_s` = the longest minus this rank's
--   (how much later than the first rank it arrived; independent of clock offsets between
--   hosts), `start_late_s` = the same from kernel start stamps.
--
-- ```sql
-- SELECT rank, step, round(sum(late_s), 3) AS late_s, round(sum(wait_s), 3) AS wait_s
-- FROM phase_collectives GROUP BY ALL ORDER BY step, rank;
-- ```
CREATE OR REPLACE VIEW phase_gpu_events AS
WITH g AS (
    SELECT file_id, rank, name, stream, coll_name, pg_name, start_us, end_us,
           (coll_name IS NOT NULL OR regexp_matches(name, _phase_setting('nccl_kernel_regex'))) AS is_nccl
    FROM _phase_trace
    WHERE source = 'kineto' AND ph = 'X' AND _phase_gpu_category(category)
)
SELECT file_id, rank, CASE WHEN is_nccl THEN name END AS name, stream, coll_name, pg_name, start_us, end_us,
       (end_us - start_us) / 1e6 AS seconds, is_nccl
FROM g;

-- Back-to-back events of one CUDA stream merged into busy intervals
-- (file_id, rank, stream, is_nccl, start_us, end_us, events).
CREATE OR REPLACE VIEW _phase_gpu_islands AS
WITH ordered AS (
    -- events of one CUDA stream run one after the other: a new island starts after a gap
    SELECT file_id, rank, stream, is_nccl, start_us, end_us,
           lag(end_us) OVER (PARTITION BY file_id, stream, is_nccl ORDER BY start_us, end_us) AS prev_end
    FROM phase_gpu_events
), marked AS (
    SELECT *, sum(CASE WHEN prev_end IS NULL OR start_us > prev_end THEN 1 ELSE 0 END)
                  OVER (PARTITION BY file_id, stream, is_nccl ORDER BY start_us, end_us ROWS UNBOUNDED PRECEDING) AS island
    FROM ordered
)
SELECT file_id, rank, stream, is_nccl, min(start_us) AS start_us, max(end_us) AS end_us, count(*) AS events
FROM marked GROUP BY file_id, rank, stream, is_nccl, island;

CREATE OR REPLACE VIEW phase_gpu AS
SELECT s.file_id, s.rank, s.step, s.phase, s.sub_phase,
       coalesce(sum(g.seconds) FILTER (WHERE NOT g.is_nccl), 0) AS kernel_s,
       coalesce(sum(g.seconds) FILTER (WHERE g.is_nccl), 0) AS nccl_s,
       count(*) AS events
FROM phase_gpu_events g
ASOF JOIN _phase_kineto_segments s ON g.file_id = s.file_id AND g.start_us >= s.start_us
WHERE g.start_us < s.end_us
GROUP BY s.file_id, s.rank, s.step, s.phase, s.sub_phase;

CREATE OR REPLACE VIEW phase_gpu_steps AS
WITH ordered AS (
    -- the union of the streams' islands: overlapping streams count once
    SELECT file_id, start_us, end_us,
           max(end_us) OVER (PARTITION BY file_id ORDER BY start_us, end_us
                             ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_end
    FROM _phase_gpu_islands
), marked AS (
    SELECT *, sum(CASE WHEN prev_end IS NULL OR start_us > prev_end THEN 1 ELSE 0 END)
                  OVER (PARTITION BY file_id ORDER BY start_us, end_us ROWS UNBOUNDED PRECEDING) AS island
    FROM ordered
), islands AS (
    SELECT file_id, island, min(start_us) AS start_us, max(end_us) AS end_us FROM marked GROUP BY file_id, island
), busy AS (
    SELECT w.file_id, w.step, sum(least(i.end_us, w.end_us) - i.start_us) / 1e6 AS busy_s
    FROM islands i ASOF JOIN phase_profiler_steps w ON i.file_id = w.file_id AND i.start_us >= w.start_us
    WHERE i.start_us < w.end_us
    GROUP BY w.file_id, w.step
), sums AS (
    SELECT w.file_id, w.step, sum(g.seconds) FILTER (WHERE NOT g.is_nccl) AS kernel_s,
           sum(g.seconds) FILTER (WHERE g.is_nccl) AS nccl_s
    FROM phase_gpu_events g ASOF JOIN phase_profiler_steps w ON g.file_id = w.file_id AND g.start_us >= w.start_us
    WHERE g.start_us < w.end_us
    GROUP BY w.file_id, w.step
)
SELECT w.file_id, w.rank, w.step, w.step_s, coalesce(b.busy_s, 0) AS gpu_busy_s,
       w.step_s - coalesce(b.busy_s, 0) AS gpu_idle_s,
       coalesce(s.kernel_s, 0) AS kernel_s, coalesce(s.nccl_s, 0) AS nccl_s
FROM phase_profiler_steps w
LEFT JOIN busy b ON b.file_id = w.file_id AND b.step = w.step
LEFT JOIN sums s ON s.file_id = w.file_id AND s.step = w.step
WHERE w.file_id IN (SELECT DISTINCT file_id FROM _phase_gpu_islands);

-- `phase_collectives` without the phase (and with `file_id`).
CREATE OR REPLACE VIEW _phase_collective_matches AS
WITH nk AS (
    SELECT g.file_id, g.rank, w.step, coalesce(g.pg_name, '') AS pg_name,
           coalesce(g.coll_name, nullif(regexp_extract(g.name, _phase_setting('nccl_coll_from_kernel_regex'), 1), ''), g.name) AS coll_name,
           g.start_us, g.seconds
    FROM phase_gpu_events g
    ASOF JOIN phase_profiler_steps w ON g.file_id = w.file_id AND g.start_us >= w.start_us
    WHERE g.is_nccl
), numbered AS (
    SELECT *, row_number() OVER (PARTITION BY file_id, step, pg_name, coll_name ORDER BY start_us) AS idx FROM nk
), inst AS (
    SELECT n.*, count(*) OVER w AS n, min(seconds) OVER w AS min_s, max(seconds) OVER w AS max_s,
           min(start_us) OVER w AS first_start,
           count(DISTINCT rank) OVER (PARTITION BY step) AS n_ranks
    FROM numbered n
    WINDOW w AS (PARTITION BY step, pg_name, coll_name, idx)
)
SELECT step, pg_name, coll_name, idx, file_id, rank, start_us, seconds,
       seconds - min_s AS wait_s, max_s - seconds AS late_s, (start_us - first_start) / 1e6 AS start_late_s
FROM inst WHERE n = n_ranks AND n >= 2;

CREATE OR REPLACE VIEW phase_collectives AS
SELECT m.step, m.pg_name, m.coll_name, m.idx, m.rank, s.phase, s.sub_phase, m.start_us, m.seconds,
       m.wait_s, m.late_s, m.start_late_s
FROM _phase_collective_matches m
ASOF LEFT JOIN (
    -- the pieces the ASOF join can pick (none that starts after the file's last collective):
    -- it sorts what it is given, and kernels are often traced for a few steps only
    SELECT k.file_id, k.start_us, k.phase, k.sub_phase
    FROM _phase_kineto_segments k
    JOIN (SELECT file_id, max(start_us) AS last_us FROM _phase_collective_matches GROUP BY file_id) l
      ON l.file_id = k.file_id AND k.start_us <= l.last_us
) s ON m.file_id = s.file_id AND m.start_us >= s.start_us;
