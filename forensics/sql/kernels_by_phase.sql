-- depends: _phase_trace, _phase_kineto_segments, phase_gpu
--
-- `kernel_time_by_phase`: GPU time per rank and phase over the profiled steps (from
-- `phase_gpu`: a GPU event belongs to the phase that was open on the CPU when it started):
-- `kernel_s` compute kernels, memcpy and memset; `nccl_s` NCCL collectives; `gpu_s` both;
-- `share` = this phase's part of the rank's `gpu_s`; `steps` profiled steps seen.
-- Phase `idle` = GPU work launched while no phase annotation was open.
--
-- `top_kernels_by_phase`: every GPU kernel name per phase, summed over ranks and steps,
-- ranked by GPU time within its phase (`position` 1 = the most time). `short_name` is the
-- name without template arguments and parameter lists.
--
-- ```sql
-- SELECT rank, phase, round(kernel_s, 3) AS kernel_s, round(nccl_s, 3) AS nccl_s,
--        round(100 * share, 1) AS pct
-- FROM kernel_time_by_phase ORDER BY rank, gpu_s DESC;
-- -- the five kernels that cost the most in each phase
-- SELECT phase, position, short_name, calls, round(total_s, 4) AS total_s, round(mean_us, 1) AS mean_us
-- FROM top_kernels_by_phase WHERE position <= 5 ORDER BY phase, position;
-- ```
CREATE OR REPLACE VIEW kernel_time_by_phase AS
WITH per_phase AS (
    SELECT rank, phase, count(DISTINCT step) AS steps, sum(kernel_s) AS kernel_s, sum(nccl_s) AS nccl_s,
           sum(events)::BIGINT AS events
    FROM phase_gpu
    GROUP BY rank, phase
)
SELECT rank, phase, steps, kernel_s, nccl_s, kernel_s + nccl_s AS gpu_s,
       (kernel_s + nccl_s) / nullif(sum(kernel_s + nccl_s) OVER (PARTITION BY rank), 0) AS share,
       events
FROM per_phase;

CREATE OR REPLACE VIEW top_kernels_by_phase AS
WITH k AS (
    SELECT g.file_id, g.rank, g.name, g.start_us, g.dur_us / 1e6 AS seconds
    FROM _phase_trace g
    WHERE g.source = 'kineto' AND g.ph = 'X' AND g.category = 'kernel'
), placed AS (
    SELECT s.phase, k.rank, s.step, k.name, k.seconds
    FROM k ASOF JOIN _phase_kineto_segments s ON k.file_id = s.file_id AND k.start_us >= s.start_us
    WHERE k.start_us < s.end_us
), summed AS (
    SELECT phase, name, count(*) AS calls, sum(seconds) AS total_s, avg(seconds) * 1e6 AS mean_us,
           max(seconds) * 1e6 AS max_us, count(DISTINCT rank) AS ranks, count(DISTINCT step) AS steps
    FROM placed
    GROUP BY phase, name
)
SELECT phase,
       row_number() OVER (PARTITION BY phase ORDER BY total_s DESC, name) AS position,
       regexp_replace(regexp_replace(replace(name, '(anonymous namespace)::', ''), '^void ', ''), '[<(].*$', '') AS short_name,
       calls, total_s, mean_us, max_us, ranks, steps,
       total_s / nullif(sum(total_s) OVER (PARTITION BY phase), 0) AS share,
       name
FROM summed;
