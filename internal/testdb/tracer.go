package testdb

import (
	"context"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Tracer is a pgx tracer (set it as ConnConfig.Tracer) that calls
// OnRoundTrip as each round trip to PostgreSQL starts: a statement sent on
// its own, or a batch of statements sent together. Tests use it to count
// round trips, and to act at a chosen statement (hold a COMMIT, kill the
// process just before one).
type Tracer struct {
	OnRoundTrip func(ctx context.Context, conn *pgx.Conn, statements []string)
}

var (
	_ pgx.QueryTracer = (*Tracer)(nil)
	_ pgx.BatchTracer = (*Tracer)(nil)
)

// TraceQueryStart implements pgx.QueryTracer.
func (t *Tracer) TraceQueryStart(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	t.OnRoundTrip(ctx, conn, []string{data.SQL})
	return ctx
}

// TraceQueryEnd implements pgx.QueryTracer.
func (t *Tracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TraceBatchStart implements pgx.BatchTracer.
func (t *Tracer) TraceBatchStart(ctx context.Context, conn *pgx.Conn, data pgx.TraceBatchStartData) context.Context {
	statements := make([]string, len(data.Batch.QueuedQueries))
	for i, q := range data.Batch.QueuedQueries {
		statements[i] = q.SQL
	}
	t.OnRoundTrip(ctx, conn, statements)
	return ctx
}

// TraceBatchQuery implements pgx.BatchTracer.
func (t *Tracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

// TraceBatchEnd implements pgx.BatchTracer.
func (t *Tracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// HasCommit reports whether any of statements is a COMMIT.
func HasCommit(statements []string) bool {
	for _, s := range statements {
		if strings.EqualFold(strings.TrimSpace(s), "commit") {
			return true
		}
	}
	return false
}
