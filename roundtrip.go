package idempotency

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The round trips every fresh call makes (the claim's, the commit's, the end
// of a call that did not commit) go to PostgreSQL as pgx would send them in
// its default query mode, on statements prepared once per connection, but
// through pgconn's batch rather than pgx's pipeline: pgx keeps a queue of
// requests for each statement in a pipeline, at a dozen allocations and a
// few microseconds each, which a call of a dozen statements paid on every
// call. What PostgreSQL receives is the same (Bind, Describe where the
// statement returns nothing, Execute, and one Sync), and so are the
// statements a pgx tracer sees (BatchTracer) and the errors the engine reads.
// A connection configured for another query mode (a pooler that cannot
// carry prepared statements) sends them through pgx.

// batchReader reads a round trip's results, statement by statement: what
// the engine uses of pgx.BatchResults.
type batchReader interface {
	Exec() (pgconn.CommandTag, error)
	QueryRow() pgx.Row
	Close() error
}

// roundTrip sends b in one round trip and returns its results.
func roundTrip(ctx context.Context, conn *pgx.Conn, b *pgx.Batch) batchReader {
	cs := connStatementsOf(conn)
	if !cs.prepares {
		return conn.SendBatch(ctx, b)
	}
	if cs.tracer != nil {
		ctx = cs.tracer.TraceBatchStart(ctx, conn, pgx.TraceBatchStartData{Batch: b})
	}
	r := &batchResults{ctx: ctx, conn: conn, cs: cs, tracer: cs.tracer, b: b}
	sts, err := cs.statementsOf(ctx, conn, b)
	if err != nil {
		r.err, r.closed = err, true
		r.traceEnd()
		return r
	}
	var batch pgconn.Batch
	eqb := &cs.eqb
	for i, q := range b.QueuedQueries {
		st := sts[i]
		if err := eqb.Build(conn.TypeMap(), st.sd, q.Arguments); err != nil {
			r.err, r.closed = fmt.Errorf("idempotency: encode the arguments of %q: %w", q.SQL, err), true
			r.traceEnd()
			return r
		}
		batch.ExecStatement(st.sd, eqb.ParamValues, eqb.ParamFormats, st.resultFormats)
	}
	r.mrr = conn.PgConn().ExecBatch(ctx, &batch)
	return r
}

// connStatements are the engine's statements prepared on one connection,
// by their SQL, kept in the connection's CustomData.
type connStatements struct {
	// prepares: the connection prepares its statements (pgx's
	// QueryExecModeCacheStatement), so the engine's round trips use its own.
	prepares bool
	tracer   pgx.BatchTracer
	bySQL    map[string]preparedStatement
	// eqb encodes the arguments of the connection's round trips, into
	// buffers it keeps from one to the next, and scratch holds a round
	// trip's statements.
	eqb     pgx.ExtendedQueryBuilder
	scratch []preparedStatement
}

type preparedStatement struct {
	sd            *pgconn.StatementDescription
	resultFormats []int16
}

// statementsKey keys a connection's connStatements in its CustomData.
const statementsKey = "idempotency.statements"

// connStatementsOf returns conn's connStatements, made at its first use.
func connStatementsOf(conn *pgx.Conn) *connStatements {
	data := conn.PgConn().CustomData()
	if cs, ok := data[statementsKey].(*connStatements); ok {
		return cs
	}
	cfg := conn.Config() // a copy: read once per connection
	cs := &connStatements{prepares: cfg.DefaultQueryExecMode == pgx.QueryExecModeCacheStatement, bySQL: map[string]preparedStatement{}}
	cs.tracer, _ = cfg.Tracer.(pgx.BatchTracer)
	data[statementsKey] = cs
	return cs
}

// forget drops conn's prepared statements from the engine's record, after
// pgx deallocated every statement of the connection (Conn.DeallocateAll).
func forgetStatements(conn *pgx.Conn) {
	if cs, ok := conn.PgConn().CustomData()[statementsKey].(*connStatements); ok {
		clear(cs.bySQL)
	}
}

// statementsOf returns the prepared statements of b's queries, in order,
// preparing those the connection does not have yet (see prepare).
func (cs *connStatements) statementsOf(ctx context.Context, conn *pgx.Conn, b *pgx.Batch) ([]preparedStatement, error) {
	sts := cs.scratch[:0]
	var missing []string
	for _, q := range b.QueuedQueries {
		st, ok := cs.bySQL[q.SQL]
		if !ok {
			missing = append(missing, q.SQL)
		}
		sts = append(sts, st)
	}
	cs.scratch = sts
	if len(missing) == 0 {
		return sts, nil
	}
	if err := cs.prepare(ctx, conn, missing); err != nil {
		return nil, err
	}
	for i, q := range b.QueuedQueries {
		sts[i] = cs.bySQL[q.SQL]
	}
	return sts, nil
}

// prepare prepares the statements of SQL missing, of which the engine has
// no record on the connection, in one round trip, as pgx does before a batch of
// statements new to a connection. Each is closed first, which is no error
// when it does not exist: a record dropped after an error (see fail) may
// have been of statements that the server still has.
//
// The record goes stale when a statement vanishes without the engine
// seeing it go (pgx's DeallocateAll called by the application, in a pool's
// AfterRelease say, or a DEALLOCATE in a function): the next round trip
// fails with invalid_sql_statement_name, drops the record (fail), and the
// engine claims once more (claimFailed), which prepares them again.
func (cs *connStatements) prepare(ctx context.Context, conn *pgx.Conn, missing []string) error {
	p := conn.PgConn().StartPipeline(ctx)
	names := make([]string, len(missing))
	for i, sql := range missing {
		digest := sha256.Sum256([]byte(sql))
		names[i] = "idempotency_" + hex.EncodeToString(digest[:24])
		p.SendDeallocate(names[i])
		p.SendPrepare(names[i], sql, nil)
	}
	err := p.Sync()
	prepared := make([]*pgconn.StatementDescription, 0, len(missing))
	for i := 0; err == nil && i < len(missing); i++ {
		var res any
		if res, err = p.GetResults(); err == nil {
			if _, ok := res.(*pgconn.CloseComplete); !ok {
				err = fmt.Errorf("idempotency: prepare: expected a close, got %T", res)
				break
			}
			res, err = p.GetResults()
		}
		if err == nil {
			sd, ok := res.(*pgconn.StatementDescription)
			if !ok {
				err = fmt.Errorf("idempotency: prepare: expected a statement description, got %T", res)
				break
			}
			sd.Name, sd.SQL = names[i], missing[i]
			prepared = append(prepared, sd)
		}
	}
	if err == nil {
		var res any
		if res, err = p.GetResults(); err == nil {
			if _, ok := res.(*pgconn.PipelineSync); !ok {
				err = fmt.Errorf("idempotency: prepare: expected a sync, got %T", res)
			}
		}
	}
	if cerr := p.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		// Whatever was prepared before the error is not recorded, and is
		// prepared again under the same name: deallocate it first.
		for _, sd := range prepared {
			_ = conn.PgConn().Deallocate(ctx, sd.Name)
		}
		return err
	}
	for i, sd := range prepared {
		formats := make([]int16, len(sd.Fields))
		for j, f := range sd.Fields {
			formats[j] = conn.TypeMap().FormatCodeForOID(f.DataTypeOID)
		}
		cs.bySQL[missing[i]] = preparedStatement{sd: sd, resultFormats: formats}
	}
	return nil
}

// batchResults are the results of a round trip sent through pgconn's batch.
type batchResults struct {
	ctx    context.Context
	conn   *pgx.Conn
	cs     *connStatements
	tracer pgx.BatchTracer
	b      *pgx.Batch
	mrr    *pgconn.MultiResultReader
	// n is the number of results read.
	n int
	// err is the first error: every result after it fails with it.
	err    error
	closed bool
}

var errBatchShort = errors.New("idempotency: the round trip returned fewer results than it sent statements")

// next returns the next statement's result reader, or the error that
// stopped the round trip.
func (r *batchResults) next() (*pgconn.ResultReader, error) {
	if r.err != nil {
		return nil, r.err
	}
	if r.closed {
		return nil, errors.New("idempotency: batch already closed")
	}
	if !r.mrr.NextResult() {
		r.fail(r.mrr.Close())
		if r.err == nil {
			r.err = errBatchShort
		}
		return nil, r.err
	}
	return r.mrr.ResultReader(), nil
}

// Exec reads the next statement's result, as pgx.BatchResults.Exec.
func (r *batchResults) Exec() (pgconn.CommandTag, error) {
	rr, err := r.next()
	var tag pgconn.CommandTag
	if err == nil {
		tag, err = rr.Close()
		r.fail(err)
	}
	r.trace(tag, err)
	return tag, err
}

// QueryRow reads the next statement's result, as pgx.BatchResults.QueryRow: the first row of the next result,
// scanned with the connection's type map; pgx.ErrNoRows when it has none.
func (r *batchResults) QueryRow() pgx.Row { return (*batchRow)(r) }

type batchRow batchResults

// Scan implements pgx.Row.
func (row *batchRow) Scan(dest ...any) error {
	r := (*batchResults)(row)
	rr, err := r.next()
	if err != nil {
		r.trace(pgconn.CommandTag{}, err)
		return err
	}
	var scanErr error
	found := rr.NextRow()
	if found {
		fields, values := rr.FieldDescriptions(), rr.Values()
		if len(fields) != len(dest) {
			scanErr = fmt.Errorf("idempotency: %d columns scanned into %d destinations", len(fields), len(dest))
		}
		for i := 0; scanErr == nil && i < len(dest); i++ {
			if err := r.conn.TypeMap().Scan(fields[i].DataTypeOID, fields[i].Format, values[i], dest[i]); err != nil {
				scanErr = fmt.Errorf("idempotency: scan column %s: %w", fields[i].Name, err)
			}
		}
	}
	tag, err := rr.Close()
	r.fail(err)
	r.trace(tag, err)
	switch {
	case err != nil:
		return err
	case scanErr != nil:
		return scanErr
	case !found:
		return pgx.ErrNoRows
	}
	return nil
}

// Close, as pgx.BatchResults.Close, reads what is left of the round
// trip, and returns the first error.
func (r *batchResults) Close() error {
	if r.closed {
		return r.err
	}
	r.closed = true
	if r.mrr != nil {
		err := r.mrr.Close()
		if r.err == nil {
			r.fail(err)
		}
	}
	r.traceEnd()
	return r.err
}

// fail keeps err as the round trip's error. A statement that the server
// does not have drops the engine's record of the connection's statements,
// which the next round trip prepares again (see prepare).
func (r *batchResults) fail(err error) {
	if err == nil {
		return
	}
	r.err = err
	if sqlState(err) == sqlInvalidStatementName {
		clear(r.cs.bySQL)
	}
}

func (r *batchResults) trace(tag pgconn.CommandTag, err error) {
	if r.tracer != nil && r.n < len(r.b.QueuedQueries) {
		q := r.b.QueuedQueries[r.n]
		r.tracer.TraceBatchQuery(r.ctx, r.conn, pgx.TraceBatchQueryData{SQL: q.SQL, Args: q.Arguments, CommandTag: tag, Err: err})
	}
	r.n++
}

func (r *batchResults) traceEnd() {
	if r.tracer != nil {
		r.tracer.TraceBatchEnd(r.ctx, r.conn, pgx.TraceBatchEndData{Err: r.err})
	}
}

// stmtBatch is a batch of the engine's statements, in storage of its own
// that serves the attempt's round trips one after the other.
type stmtBatch struct {
	b     pgx.Batch
	q     [16]pgx.QueuedQuery
	p     [16]*pgx.QueuedQuery
	args  [24]any
	nargs int
}

// reset empties s for the next round trip, and returns it.
func (s *stmtBatch) reset() *stmtBatch {
	s.b.QueuedQueries, s.nargs = s.p[:0], 0
	return s
}

// len is the number of statements in s.
func (s *stmtBatch) len() int { return len(s.b.QueuedQueries) }

// queue adds a statement to s, as pgx.Batch.Queue.
func (s *stmtBatch) queue(sql string, args ...any) {
	n := len(s.b.QueuedQueries)
	if n == len(s.q) || s.nargs+len(args) > len(s.args) {
		s.b.Queue(sql, args...)
		return
	}
	a := s.args[s.nargs : s.nargs+len(args) : s.nargs+len(args)]
	copy(a, args)
	s.nargs += len(args)
	s.q[n] = pgx.QueuedQuery{SQL: sql, Arguments: a}
	s.p[n] = &s.q[n]
	s.b.QueuedQueries = append(s.b.QueuedQueries, s.p[n])
}
