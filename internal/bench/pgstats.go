package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// appName is the application_name of every connection the tool opens, so
// that other sessions on the server can be told apart.
const appName = "idempotency-bench"

// pgCounters is one reading of PostgreSQL's cumulative statistics.
type pgCounters struct {
	commits, rollbacks int64  // pg_stat_database of the bench database
	otherXacts         int64  // transactions of every other database
	otherSessions      int64  // sessions in the bench database that are not ours
	walBytes           int64  // pg_current_wal_lsn, in bytes
	walLSN, flushLSN   string // pg_current_wal_lsn and pg_current_wal_flush_lsn
	walRecords, walFPI int64  // pg_stat_wal
	walSyncs           int64  // pg_stat_wal.wal_sync: fsyncs of the WAL
	nextXid            int64  // xmax of a fresh snapshot
	tables             map[string]tableCounters
	// backendCPU is the CPU time used so far by each backend of the pools,
	// by process ID (empty when PostgreSQL runs on another machine).
	backendCPU map[uint32]time.Duration
}

// tableCounters are pg_stat_user_tables figures of one table.
type tableCounters struct {
	Dead    int64 `json:"dead"`
	Ins     int64 `json:"ins"`
	Upd     int64 `json:"upd"`
	HotUpd  int64 `json:"hot"`
	Del     int64 `json:"del"`
	Vacuums int64 `json:"vac"`
}

// pgStats reads PostgreSQL's statistics on a connection of its own.
//
// PostgreSQL counts a backend's activity in the backend first and flushes
// it to the shared statistics at most once a second, or up to ten seconds
// later when the backend goes idle. So that a reading holds everything done
// before it, every connection of the tool is made to flush first
// (pg_stat_force_next_flush, PostgreSQL 15+); each such flush is itself a
// transaction, which selfXacts accounts for.
type pgStats struct {
	conn   *pgx.Conn
	schema string
	pools  []*pgxpool.Pool
	// walStats is pg_walinspect's pg_get_wal_stats, schema-qualified; ""
	// when the extension is not available.
	walStats string
	logf     func(string, ...any)
}

// walRecord is the WAL of one record type.
type walRecord struct {
	Count int64 `json:"count"`
	Bytes int64 `json:"bytes"` // records and full-page images
}

// findWalinspect makes pg_walinspect available to the run: the database's
// copy if it has one, else one created in the run's schema (and dropped
// with it). Without it, WAL is measured in bytes only.
func findWalinspect(ctx context.Context, conn *pgx.Conn, schema string, logf func(string, ...any)) string {
	var nsp string
	err := conn.QueryRow(ctx, `SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
WHERE e.extname = 'pg_walinspect'`).Scan(&nsp)
	if errors.Is(err, pgx.ErrNoRows) {
		nsp = schema
		_, err = conn.Exec(ctx, "CREATE EXTENSION pg_walinspect SCHEMA "+pgx.Identifier{schema}.Sanitize())
	}
	if err != nil {
		logf("WAL record types and durable commits are not counted: pg_walinspect: %v", err)
		return ""
	}
	return pgx.Identifier{nsp, "pg_get_wal_stats"}.Sanitize()
}

// walRecords counts the WAL written between two readings by record type,
// e.g. "Transaction/COMMIT": one per transaction that wrote, the durable
// commits.
func (s *pgStats) walRecords(ctx context.Context, from, to pgCounters) map[string]walRecord {
	if s.walStats == "" {
		return nil
	}
	if to.flushLSN == from.walLSN {
		return map[string]walRecord{}
	}
	rows, err := s.conn.Query(ctx, "SELECT * FROM "+s.walStats+"($1::text::pg_lsn, $2::text::pg_lsn, true) WHERE count > 0",
		pgx.QueryExecModeSimpleProtocol, from.walLSN, to.flushLSN)
	if err != nil {
		s.logf("WAL record types are no longer counted: %v", err)
		s.walStats = ""
		return nil
	}
	defer rows.Close()
	m := map[string]walRecord{}
	for rows.Next() {
		vals, err := rows.Values()
		if err != nil {
			break
		}
		name, _ := vals[0].(string)
		count, _ := vals[1].(int64)
		size, _ := vals[7].(int64)
		m[name] = walRecord{Count: count, Bytes: size}
	}
	if err := rows.Err(); err != nil {
		s.logf("WAL record types are no longer counted: %v", err)
		s.walStats = ""
		return nil
	}
	return m
}

// flushStats makes the session flush its statistics as soon as the
// statement ends. It reads a catalog row because a backend that touched no
// table since its last flush skips flushing altogether, keeping even its
// transaction counts to itself.
const flushStats = "SELECT pg_stat_force_next_flush() FROM pg_catalog.pg_class LIMIT 1"

// read flushes every pool's connections and this connection's own
// statistics, then reads. It returns the reading and how many transactions
// the flushes added.
func (s *pgStats) read(ctx context.Context) (pgCounters, int64, error) {
	var flushed int64
	cpu := map[uint32]time.Duration{}
	for _, p := range s.pools {
		for _, c := range p.AcquireAllIdle(ctx) {
			pid := c.Conn().PgConn().PID()
			if t, ok := processCPU(pid); ok {
				cpu[pid] = t
			}
			_, err := c.Exec(ctx, flushStats)
			c.Release()
			if err != nil {
				return pgCounters{}, 0, fmt.Errorf("flush statistics (needs PostgreSQL 15 or later): %w", err)
			}
			flushed++
		}
	}
	if _, err := s.conn.Exec(ctx, flushStats); err != nil {
		return pgCounters{}, 0, fmt.Errorf("flush statistics (needs PostgreSQL 15 or later): %w", err)
	}
	c := pgCounters{backendCPU: cpu}
	var tables []byte
	err := s.conn.QueryRow(ctx, `SELECT d.xact_commit, d.xact_rollback,
	(SELECT coalesce(sum(o.xact_commit + o.xact_rollback), 0)::bigint FROM pg_stat_database o
		WHERE o.datname IS NOT NULL AND o.datname <> current_database()),
	(SELECT count(*) FROM pg_stat_activity a WHERE a.datname = current_database()
		AND a.backend_type = 'client backend' AND a.application_name IS DISTINCT FROM $1),
	pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint, pg_current_wal_lsn()::text, pg_current_wal_flush_lsn()::text,
	w.wal_records, w.wal_fpi, w.wal_sync,
	pg_snapshot_xmax(pg_current_snapshot())::text::bigint,
	(SELECT coalesce(json_object_agg(t.relname, json_build_object(
		'dead', t.n_dead_tup, 'ins', t.n_tup_ins, 'upd', t.n_tup_upd, 'hot', t.n_tup_hot_upd,
		'del', t.n_tup_del, 'vac', t.vacuum_count + t.autovacuum_count)), '{}')
		FROM pg_stat_user_tables t WHERE t.schemaname = $2)
FROM pg_stat_database d, pg_stat_wal w WHERE d.datname = current_database()`,
		pgx.QueryExecModeSimpleProtocol, appName, s.schema).Scan(
		&c.commits, &c.rollbacks, &c.otherXacts, &c.otherSessions,
		&c.walBytes, &c.walLSN, &c.flushLSN, &c.walRecords, &c.walFPI, &c.walSyncs, &c.nextXid, &tables)
	if err != nil {
		return pgCounters{}, 0, fmt.Errorf("read statistics: %w", err)
	}
	if err := json.Unmarshal(tables, &c.tables); err != nil {
		return pgCounters{}, 0, fmt.Errorf("read table statistics: %w", err)
	}
	return c, flushed, nil
}

// processCPU reads the CPU time a local process has used, user and
// system, from /proc. It fails for processes on another machine.
func processCPU(pid uint32) (time.Duration, bool) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, false
	}
	// Fields after the command name, which is in parentheses and may
	// contain spaces: state is the first, utime and stime the 12th and 13th.
	i := bytes.LastIndexByte(data, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(string(data[i+1:]))
	if len(f) < 13 {
		return 0, false
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	const tick = 10 * time.Millisecond // USER_HZ is 100 on every Linux platform Go supports
	return time.Duration(utime+stime) * tick, true
}

// ownCPU is the CPU time this process (clients and servers) has used.
func ownCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// cpuBetween is the CPU time the backends present in both readings used
// between them; ok is false when it could not be read.
func cpuBetween(from, to pgCounters) (d time.Duration, ok bool) {
	for pid, t1 := range to.backendCPU {
		if t0, seen := from.backendCPU[pid]; seen {
			d += t1 - t0
			ok = true
		}
	}
	return d, ok
}

// selfXacts is how many transactions of the bench database between two
// readings are the tool's own: the first reading's query and the second
// reading's flush of this connection, plus the pools' flushes before the
// second reading. (Counting WAL records in between, after the second
// reading, is outside the window.)
func selfXacts(flushedBefore int64) int64 { return 2 + flushedBefore }
