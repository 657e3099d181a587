package idempotency

import (
	"context"
	"strconv"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// callTx is the transaction of one idempotent call, as handlers see it. The
// engine opens and ends it itself, pipelined with its own statements (BEGIN
// with the claim, the stored result with COMMIT), which pgx's own Tx cannot
// do; that saves two round trips per call. Handlers get everything but the
// right to end it: Commit and Rollback return [ErrTxOwned].
type callTx struct {
	conn       *pgx.Conn
	savepoints int // nested transactions started, for unique savepoint names

	loOnce sync.Once
	lo     pgx.Tx // a pgx Tx on the same connection, only for LargeObjects
}

var _ pgx.Tx = (*callTx)(nil)

func (t *callTx) Begin(ctx context.Context) (pgx.Tx, error) { return beginSavepoint(ctx, t, t) }

func (*callTx) Commit(context.Context) error   { return ErrTxOwned }
func (*callTx) Rollback(context.Context) error { return ErrTxOwned }

func (t *callTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	return t.conn.CopyFrom(ctx, table, cols, src)
}

func (t *callTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return t.conn.SendBatch(ctx, b)
}

// LargeObjects works inside the call's transaction. pgx builds LargeObjects
// only from its own Tx, so the first use makes one on this connection with a
// harmless statement in place of BEGIN (the transaction is already open).
func (t *callTx) LargeObjects() pgx.LargeObjects {
	t.loOnce.Do(func() {
		t.lo, _ = t.conn.BeginTx(context.Background(), pgx.TxOptions{BeginQuery: "SELECT 1"})
	})
	if t.lo == nil {
		return pgx.LargeObjects{}
	}
	return t.lo.LargeObjects()
}

func (t *callTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	return t.conn.Prepare(ctx, name, sql)
}

func (t *callTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return t.conn.Exec(ctx, sql, args...)
}

func (t *callTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return t.conn.Query(ctx, sql, args...)
}

func (t *callTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return t.conn.QueryRow(ctx, sql, args...)
}

func (t *callTx) Conn() *pgx.Conn { return t.conn }

// savepointTx is a nested transaction inside a call's transaction, made
// with SAVEPOINT like pgx's own nested transactions.
type savepointTx struct {
	pgx.Tx // the enclosing transaction, for statements
	call   *callTx
	name   string
	closed bool
}

func beginSavepoint(ctx context.Context, call *callTx, parent pgx.Tx) (pgx.Tx, error) {
	call.savepoints++
	name := "idempotency_sp_" + strconv.Itoa(call.savepoints)
	if _, err := call.conn.Exec(ctx, "SAVEPOINT "+name); err != nil {
		return nil, err
	}
	return &savepointTx{Tx: parent, call: call, name: name}, nil
}

func (s *savepointTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if s.closed {
		return nil, pgx.ErrTxClosed
	}
	return beginSavepoint(ctx, s.call, s)
}

func (s *savepointTx) Commit(ctx context.Context) error {
	if s.closed {
		return pgx.ErrTxClosed
	}
	_, err := s.call.conn.Exec(ctx, "RELEASE SAVEPOINT "+s.name)
	s.closed = true
	return err
}

func (s *savepointTx) Rollback(ctx context.Context) error {
	if s.closed {
		return pgx.ErrTxClosed
	}
	_, err := s.call.conn.Exec(ctx, "ROLLBACK TO SAVEPOINT "+s.name)
	s.closed = true
	return err
}
