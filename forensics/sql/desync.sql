-- depends: fr_entries, fr_groups, pg_events, nccl_comms, nccl_rank_map, nccl_collectives
--
-- `collective_progress`: how far each rank got in each process group, from the best evidence
-- there is. `source` says which: `flight_recorder` (the rank's dump: entries and `pg_status`),
-- `watchdog` (ProcessGroupNCCL lines: `SeqNum=`, `last enqueued/completed NCCL work`, desync
-- reports), or `nccl_coll` (NCCL_DEBUG_SUBSYS=COLL lines: calls issued per communicator; a
-- different count than torch's sequence numbers, so such groups are named `nccl:<commId>`).
-- Torch groups are keyed by their name/GUID (`pg`, `'0'` = the default group); watchdog lines
-- that name no group (torch <= 2.1) count to `'0'`. `stuck_seq`/`stuck_op`: the first
-- collective this rank enqueued but did not complete (the one its watchdog timed out on).
-- `lagging_by_report`: another rank's desync report named this rank.
--
-- `desync`: one row per (process group, expected member rank). Members are the group's ranks
-- from the Flight Recorder `pg_config`; else 0..world_size-1 where world_size is the largest
-- of: communicator `nranks` (default group, or the NCCL group itself), the Flight Recorder
-- group size, the highest rank seen + 1. `wait_seq`/`wait_op` is the collective most ranks of
-- the group are stuck in. `status`:
-- `missing` (no dump, no watchdog line, no collective line: a suspect, not a bystander),
-- `behind` (completed less than the others, never enqueued the collective they wait in, or
-- named lagging by a desync report), `waiting` (stuck in the group's collective, like the
-- others), `waiting_elsewhere` (stuck in another collective), `ok`. `reason` says why.
--
-- ```sql
-- SELECT pg, rank, status, source, last_completed, stuck_seq, wait_seq, wait_op, reason
-- FROM desync ORDER BY pg, rank;
-- -- the suspects
-- SELECT pg, rank, status, reason FROM desync WHERE status IN ('missing', 'behind');
-- ```
CREATE OR REPLACE VIEW collective_progress AS
WITH
fr_ops AS (
    SELECT rank, coalesce(pg_name, pg_id::VARCHAR) AS pg, pg_desc, collective_seq_id AS seq, op, state
    FROM fr_entries
    WHERE NOT coalesce(is_p2p, false) AND rank IS NOT NULL AND collective_seq_id IS NOT NULL
),
fr_agg AS (
    SELECT
        rank, pg, any_value(pg_desc) AS pg_desc,
        max(seq) AS last_enqueued,
        max(seq) FILTER (WHERE state IN ('started', 'completed')) AS last_started,
        max(seq) FILTER (WHERE state = 'completed') AS last_completed,
        min(seq) FILTER (WHERE state <> 'completed') AS stuck_seq,
        arg_min(op, seq) FILTER (WHERE state <> 'completed') AS stuck_op
    FROM fr_ops GROUP BY rank, pg
),
fr_status AS (
    SELECT rank, coalesce(pg_name, pg_id::VARCHAR) AS pg, any_value(pg_desc) AS pg_desc,
           max(last_enqueued) AS last_enqueued,
           max(nullif(last_started, -1)) AS last_started,
           max(last_completed) AS last_completed
    FROM fr_groups WHERE rank IS NOT NULL GROUP BY ALL
),
fr AS (
    SELECT
        coalesce(a.rank, s.rank) AS rank,
        coalesce(a.pg, s.pg) AS pg,
        coalesce(a.pg_desc, s.pg_desc) AS pg_desc,
        greatest(a.last_enqueued, s.last_enqueued) AS last_enqueued,
        coalesce(s.last_started, a.last_started) AS last_started,
        coalesce(s.last_completed, a.last_completed) AS last_completed,
        a.stuck_seq, a.stuck_op
    FROM fr_agg a FULL OUTER JOIN fr_status s ON a.rank = s.rank AND a.pg = s.pg
),
pg_lines AS (
    SELECT
        coalesce(p.rank, m.rank) AS rank,
        coalesce(p.pg_name, p.pg_id::VARCHAR, '0') AS pg,
        p.pg_desc, p.kind, p.seq, p.op_type, p.last_enqueued, p.last_completed, p.ranks, p.line_no, p.file_id
    FROM pg_events p
    LEFT JOIN nccl_rank_map m
      ON p.rank IS NULL AND p.pid = m.pid
     AND (p.node IS NULL OR p.node = m.host OR list_contains(m.nodes, p.node))
    WHERE p.seq IS NOT NULL OR p.last_enqueued IS NOT NULL OR p.last_completed IS NOT NULL
),
wd AS (
    SELECT
        rank, pg, any_value(pg_desc) AS pg_desc,
        max(last_enqueued) AS last_enqueued,
        max(last_completed) AS last_completed,
        min(seq) FILTER (WHERE kind IN ('watchdog_timeout', 'watchdog_terminated', 'dist_backend_error', 'work_status')) AS stuck_seq,
        arg_min(op_type, seq) FILTER (WHERE kind IN ('watchdog_timeout', 'watchdog_terminated', 'dist_backend_error') AND op_type IS NOT NULL) AS stuck_op
    FROM pg_lines
    WHERE rank IS NOT NULL AND kind NOT IN ('desync_lagging', 'desync_started', 'desync_not_joined')
    GROUP BY rank, pg
),
lagging AS (
    SELECT DISTINCT pg, unnest(ranks) AS rank
    FROM pg_lines WHERE kind IN ('desync_lagging', 'desync_started', 'desync_not_joined') AND ranks IS NOT NULL
),
coll_files AS (
    SELECT rank, 'nccl:' || coalesce(comm_id, 'nranks=' || nranks::VARCHAR) AS pg, file_id,
           count(*) AS calls, arg_max(op, call_no) AS last_op
    FROM nccl_collectives WHERE rank IS NOT NULL GROUP BY ALL
),
coll AS (
    SELECT rank, pg, max(calls) AS last_enqueued, arg_max(last_op, calls) AS last_op
    FROM coll_files GROUP BY rank, pg
),
torch_side AS (
    SELECT
        coalesce(fr.rank, wd.rank) AS rank,
        coalesce(fr.pg, wd.pg) AS pg,
        coalesce(fr.pg_desc, wd.pg_desc) AS pg_desc,
        CASE WHEN fr.rank IS NOT NULL THEN 'flight_recorder' ELSE 'watchdog' END AS source,
        coalesce(fr.last_enqueued, wd.last_enqueued) AS last_enqueued,
        fr.last_started,
        coalesce(fr.last_completed, wd.last_completed) AS last_completed,
        coalesce(fr.stuck_seq, wd.stuck_seq) AS stuck_seq,
        coalesce(fr.stuck_op, wd.stuck_op) AS stuck_op
    FROM fr FULL OUTER JOIN wd ON fr.rank = wd.rank AND fr.pg = wd.pg
),
all_sources AS (
    SELECT * FROM torch_side
    UNION ALL
    SELECT rank, pg, NULL AS pg_desc, 'nccl_coll' AS source, last_enqueued, NULL AS last_started,
           NULL AS last_completed, NULL AS stuck_seq, last_op AS stuck_op
    FROM coll
)
SELECT s.*, (l.rank IS NOT NULL) AS lagging_by_report
FROM all_sources s
LEFT JOIN lagging l ON l.pg = s.pg AND l.rank = s.rank;

CREATE OR REPLACE VIEW desync AS
WITH
groups AS (
    SELECT pg, any_value(pg_desc) AS pg_desc, max(rank) AS max_rank, any_value(source) AS source
    FROM collective_progress GROUP BY pg
),
fr_members AS (
    SELECT coalesce(pg_name, pg_id::VARCHAR) AS pg, max(size) AS fr_size,
           arg_max(ranks, size) AS fr_ranks
    FROM fr_groups WHERE ranks IS NOT NULL GROUP BY 1
),
comm_sizes AS (
    SELECT max(nranks) AS world_nranks FROM nccl_comms
),
nccl_groups AS (
    SELECT 'nccl:' || coalesce(comm_id, 'nranks=' || nranks::VARCHAR) AS pg, max(nranks) AS nranks
    FROM nccl_collectives GROUP BY 1
),
sized AS (
    SELECT
        g.pg, g.pg_desc, f.fr_ranks,
        greatest(
            g.max_rank + 1,
            f.fr_size,
            n.nranks,
            CASE WHEN g.pg = '0' OR g.pg_desc = 'default_pg' THEN c.world_nranks END
        ) AS world_size
    FROM groups g
    LEFT JOIN fr_members f USING (pg)
    LEFT JOIN nccl_groups n USING (pg)
    CROSS JOIN comm_sizes c
),
members AS (
    SELECT pg, pg_desc, world_size, unnest(coalesce(fr_ranks, range(0, world_size)::INTEGER[])) AS rank
    FROM sized
),
group_state AS (
    SELECT
        pg,
        max(last_completed) AS max_completed,
        max(last_enqueued) AS max_enqueued,
        mode(stuck_seq) AS wait_seq
    FROM collective_progress GROUP BY pg
),
wait_ops AS (
    SELECT p.pg, mode(p.stuck_op) AS wait_op
    FROM collective_progress p JOIN group_state s ON p.pg = s.pg AND p.stuck_seq = s.wait_seq
    GROUP BY p.pg
)
SELECT
    m.pg,
    m.pg_desc,
    m.world_size,
    m.rank,
    p.source,
    p.last_enqueued,
    p.last_started,
    p.last_completed,
    p.stuck_seq,
    p.stuck_op,
    s.wait_seq,
    w.wait_op,
    CASE
        WHEN p.rank IS NULL THEN 'missing'
        WHEN p.lagging_by_report THEN 'behind'
        WHEN p.last_completed < s.max_completed THEN 'behind'
        WHEN p.last_enqueued < s.wait_seq THEN 'behind'
        WHEN p.source = 'nccl_coll' AND p.last_enqueued < s.max_enqueued THEN 'behind'
        WHEN p.stuck_seq = s.wait_seq THEN 'waiting'
        WHEN p.stuck_seq IS NOT NULL THEN 'waiting_elsewhere'
        ELSE 'ok'
    END AS status,
    CASE
        WHEN p.rank IS NULL THEN 'no Flight Recorder dump, no watchdog line and no collective line for this group'
        WHEN p.lagging_by_report THEN 'named as lagging by a desync report'
        WHEN p.last_completed < s.max_completed THEN 'completed collective ' || p.last_completed || ', others reached ' || s.max_completed
        WHEN p.last_enqueued < s.wait_seq THEN 'last enqueued collective ' || p.last_enqueued || ' is before ' || s.wait_seq || ', which the others wait in'
        WHEN p.source = 'nccl_coll' AND p.last_enqueued < s.max_enqueued THEN 'issued ' || p.last_enqueued || ' collectives, others ' || s.max_enqueued
        WHEN p.stuck_seq = s.wait_seq THEN 'stuck in collective ' || p.stuck_seq || coalesce(' (' || p.stuck_op || ')', '') || ' like the others'
        WHEN p.stuck_seq IS NOT NULL THEN 'stuck in collective ' || p.stuck_seq || ', the others in ' || coalesce(s.wait_seq::VARCHAR, '?')
        ELSE 'no sign of trouble'
    END AS reason
FROM members m
LEFT JOIN collective_progress p ON p.pg = m.pg AND p.rank = m.rank
LEFT JOIN group_state s ON s.pg = m.pg
LEFT JOIN wait_ops w ON w.pg = m.pg;
