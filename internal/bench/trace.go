package main

import (
	"context"
	"net"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// wire counts what crosses the sockets of one pool. It is the ground truth
// for round trips: anything pgx or the library sends, traced or not
// (pipelines, pings, batch prepares, cancel requests), is seen here.
type wire struct {
	roundTrips, bytesOut, bytesIn atomic.Int64
}

// wrap is a pgconn AfterNetConnect hook that counts the connection's traffic.
func (w *wire) wrap(_ context.Context, _ *pgconn.Config, conn net.Conn) (net.Conn, error) {
	c := &countedConn{Conn: conn, w: w}
	c.heardBack.Store(true) // the startup message opens the first round trip
	return c, nil
}

type wireCounts struct{ RoundTrips, BytesOut, BytesIn int64 }

func (w *wire) read() wireCounts {
	return wireCounts{w.roundTrips.Load(), w.bytesOut.Load(), w.bytesIn.Load()}
}

func (a wireCounts) sub(b wireCounts) wireCounts {
	return wireCounts{a.RoundTrips - b.RoundTrips, a.BytesOut - b.BytesOut, a.BytesIn - b.BytesIn}
}

// countedConn counts a round trip each time the client writes after having
// read: a pipelined batch is one, a query that must wait for a Prepare is
// two.
type countedConn struct {
	net.Conn
	w         *wire
	heardBack atomic.Bool // read something since the last write
}

func (c *countedConn) Write(p []byte) (int, error) {
	if c.heardBack.Swap(false) {
		c.w.roundTrips.Add(1)
	}
	n, err := c.Conn.Write(p)
	c.w.bytesOut.Add(int64(n))
	return n, err
}

func (c *countedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.heardBack.Store(true)
		c.w.bytesIn.Add(int64(n))
	}
	return n, err
}

// tracer is a pgx tracer counting what the server's pool did, by the
// statements pgx was asked to run. Begin, Commit and Rollback go through
// Exec, so they are statements too; a batch is one round trip however many
// statements it holds. While a probe is set, it also records each round
// trip's statements in order, to show the shape of one call.
type tracer struct {
	roundTrips, statements, prepares, connects atomic.Int64
	// commits and rollbacks count transactions as PostgreSQL does: explicit
	// COMMIT or ROLLBACK, and statements or batches run outside a
	// transaction block (each is a transaction of its own).
	commits, rollbacks atomic.Int64
	// begins counts transaction blocks opened (BEGIN, START TRANSACTION):
	// unlike commits, it leaves out single statements run by themselves.
	begins atomic.Int64

	probing atomic.Bool // spares the lock on every statement when false
	mu      sync.Mutex
	probe   *[]string // non-nil while probing; guarded by mu
	strip   *regexp.Regexp
}

type traceCounts struct {
	RoundTrips, Statements, Prepares, Connects, Commits, Rollbacks, Begins int64
}

func (a traceCounts) sub(b traceCounts) traceCounts {
	return traceCounts{a.RoundTrips - b.RoundTrips, a.Statements - b.Statements, a.Prepares - b.Prepares,
		a.Connects - b.Connects, a.Commits - b.Commits, a.Rollbacks - b.Rollbacks, a.Begins - b.Begins}
}

func newTracer(schema string) *tracer {
	return &tracer{strip: regexp.MustCompile(regexp.QuoteMeta(`"` + schema + `".`))}
}

func (t *tracer) read() traceCounts {
	return traceCounts{
		RoundTrips: t.roundTrips.Load(), Statements: t.statements.Load(), Prepares: t.prepares.Load(),
		Connects: t.connects.Load(), Commits: t.commits.Load(), Rollbacks: t.rollbacks.Load(), Begins: t.begins.Load(),
	}
}

// startProbe begins recording round trips; stopProbe returns them.
func (t *tracer) startProbe() {
	t.mu.Lock()
	t.probe = new([]string)
	t.mu.Unlock()
	t.probing.Store(true)
}

func (t *tracer) stopProbe() []string {
	t.probing.Store(false)
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.probe
	t.probe = nil
	if p == nil {
		return nil
	}
	return *p
}

func (t *tracer) record(f func() string) {
	if !t.probing.Load() {
		return
	}
	t.mu.Lock()
	if t.probe != nil {
		*t.probe = append(*t.probe, f())
	}
	t.mu.Unlock()
}

// summary shortens a statement for the probe listing: one line, the run's
// schema name removed, at most 72 characters.
func (t *tracer) summary(sql string) string {
	s := strings.Join(strings.Fields(t.strip.ReplaceAllString(sql, "")), " ")
	if r := []rune(s); len(r) > 72 {
		s = string(r[:71]) + "…"
	}
	return s
}

func (t *tracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	t.roundTrips.Add(1)
	t.statements.Add(1)
	t.countBegin(data.SQL)
	t.record(func() string { return t.summary(data.SQL) })
	return ctx
}

func (t *tracer) TraceQueryEnd(_ context.Context, conn *pgx.Conn, data pgx.TraceQueryEndData) {
	if conn.PgConn().TxStatus() == 'I' {
		t.countEnd(data.CommandTag.String(), data.Err)
	}
}

// countEnd counts a statement or batch after which the connection is
// outside a transaction block: it ended a transaction, explicitly (COMMIT,
// ROLLBACK) or as a transaction of its own.
func (t *tracer) countEnd(tag string, err error) {
	switch {
	case tag == "ROLLBACK" || err != nil:
		t.rollbacks.Add(1)
	default: // COMMIT, or any statement that ran by itself
		t.commits.Add(1)
	}
}

type batchEndKey struct{}

// batchState notes whether a batch ended its transaction itself.
type batchState struct{ ended bool }

func (t *tracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchStartData) context.Context {
	t.roundTrips.Add(1)
	for _, q := range data.Batch.QueuedQueries {
		t.countBegin(q.SQL)
	}
	t.record(func() string {
		parts := make([]string, len(data.Batch.QueuedQueries))
		for i, q := range data.Batch.QueuedQueries {
			parts[i] = t.summary(q.SQL)
		}
		return "batch of " + strconv.Itoa(len(parts)) + ": " + strings.Join(parts, " | ")
	})
	return context.WithValue(ctx, batchEndKey{}, &batchState{})
}

// TraceBatchQuery counts explicit transaction ends inside a batch by their
// tags, as the connection's transaction status is only known once the whole
// batch has been read.
func (t *tracer) TraceBatchQuery(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	t.statements.Add(1)
	tag := data.CommandTag.String()
	if tag != "COMMIT" && (tag != "ROLLBACK" || isSavepointRollback(data.SQL)) {
		return
	}
	if tag == "COMMIT" {
		t.commits.Add(1)
	} else {
		t.rollbacks.Add(1)
	}
	if st, ok := ctx.Value(batchEndKey{}).(*batchState); ok {
		st.ended = true
	}
}

func (t *tracer) TraceBatchEnd(ctx context.Context, conn *pgx.Conn, data pgx.TraceBatchEndData) {
	if st, ok := ctx.Value(batchEndKey{}).(*batchState); ok && !st.ended && conn.PgConn().TxStatus() == 'I' {
		t.countEnd("", data.Err) // the batch ran as one transaction of its own
	}
}

// countBegin counts a statement that opens a transaction block. It runs for
// every statement, so it does not allocate.
func (t *tracer) countBegin(sql string) {
	s := strings.TrimLeft(sql, " \t\r\n")
	if hasPrefixFold(s, "begin") || hasPrefixFold(s, "start transaction") {
		t.begins.Add(1)
	}
}

func hasPrefixFold(s, prefix string) bool {
	return len(s) >= len(prefix) && strings.EqualFold(s[:len(prefix)], prefix)
}

func isSavepointRollback(sql string) bool {
	f := strings.Fields(strings.ToLower(sql))
	return len(f) > 1 && f[0] == "rollback" && f[1] == "to"
}

type prepareKey struct{}

func (t *tracer) TracePrepareStart(ctx context.Context, _ *pgx.Conn, data pgx.TracePrepareStartData) context.Context {
	return context.WithValue(ctx, prepareKey{}, data.SQL)
}

func (t *tracer) TracePrepareEnd(ctx context.Context, _ *pgx.Conn, data pgx.TracePrepareEndData) {
	if data.AlreadyPrepared {
		return
	}
	t.roundTrips.Add(1)
	t.prepares.Add(1)
	sql, _ := ctx.Value(prepareKey{}).(string)
	t.record(func() string { return "prepare: " + t.summary(sql) })
}

func (t *tracer) TraceConnectStart(ctx context.Context, _ pgx.TraceConnectStartData) context.Context {
	return ctx
}

func (t *tracer) TraceConnectEnd(context.Context, pgx.TraceConnectEndData) {
	t.connects.Add(1)
	t.record(func() string { return "connect" })
}

var (
	_ pgx.QueryTracer   = (*tracer)(nil)
	_ pgx.BatchTracer   = (*tracer)(nil)
	_ pgx.PrepareTracer = (*tracer)(nil)
	_ pgx.ConnectTracer = (*tracer)(nil)
)
