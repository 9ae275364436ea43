-- depends: lines, actor_deaths
--
-- `rank_pids`: which global rank a process (pid) holds, from every kind of evidence the logs
-- carry, one row per (pid, rank, source) with the number of lines saying so (`n`):
-- `line` (a line with both a pid and a rank: `[rankN]:` prefixes, per-rank file paths),
-- `message` (`[Rank N]`, `[rank N]`, `[actor rank N]`, a logger named `....rankN:<line> - ` printed by a
-- process whose pid is known),
-- `nccl_init` (`ncclCommInitRank ... rank R nranks N` of the largest communicator: the world),
-- `actor_name` (an `ActorDiedError` block naming `<prefix>WorkerDict_0:<R>` for a pid: the first
-- node's workers; another node's `_<p>:<l>` needs the workers per node, which diagnose reads from the config).
-- `node` is the host/IP seen with that pid. Evidence can disagree (a pid reused, a TP group
-- rank); diagnose takes the rank most lines agree on.
--
-- ```sql
-- SELECT pid, rank, source, n, node FROM rank_pids ORDER BY pid, n DESC;
-- ```
CREATE OR REPLACE VIEW rank_pids AS
WITH
nccl_init AS (
    SELECT pid, node,
           TRY_CAST(regexp_extract(message, ' rank (\d+) nranks (\d+) ', 1) AS INTEGER) AS rank,
           TRY_CAST(regexp_extract(message, ' rank (\d+) nranks (\d+) ', 2) AS INTEGER) AS nranks
    FROM lines
    WHERE header = 'nccl' AND contains(message, 'ncclCommInitRank') AND regexp_matches(message, ' rank \d+ nranks \d+ ')
),
world AS (SELECT max(nranks) AS nranks FROM nccl_init)
SELECT pid, rank, 'line' AS source, count(*) AS n, any_value(node) AS node
FROM lines WHERE pid IS NOT NULL AND rank IS NOT NULL
GROUP BY pid, rank
UNION ALL
SELECT pid, TRY_CAST(regexp_extract(message, '(?:\[(?:\w+ )?[Rr]ank[ _]?|^[\w.]+\.rank)(\d+)(?:\]|:\d+ - )', 1) AS INTEGER) AS rank,
       'message', count(*), any_value(node)
FROM lines
-- every match holds `rank` or `Rank`: two substring tests are cheaper than lower() of each line
WHERE pid IS NOT NULL AND rank IS NULL AND (contains(message, 'rank') OR contains(message, 'Rank'))
  AND regexp_matches(message, '(?:\[(?:\w+ )?[Rr]ank[ _]?|^[\w.]+\.rank)\d+(?:\]|:\d+ - )')
GROUP BY ALL
UNION ALL
SELECT pid, rank, 'nccl_init', count(*), any_value(node)
FROM nccl_init, world
WHERE nccl_init.nranks = world.nranks AND pid IS NOT NULL AND rank IS NOT NULL
GROUP BY pid, rank
UNION ALL
SELECT pid, member_index, 'actor_name', count(*), any_value(ip)
FROM actor_deaths
WHERE pid IS NOT NULL AND member_index IS NOT NULL
GROUP BY pid, member_index;
