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
//
// Once the call is over the transaction is dead, as a pgx Tx is after its
// Commit: every method returns [pgx.ErrTxClosed], so a handler that kept it
// cannot write into an idle pooled connection (autocommit) or into another
// call's transaction.
type callTx struct {
	conn *pgx.Conn
	// mu is held, shared, by each statement the handler sends, and taken
	// whole by close: once close returns, no statement of the handler's is
	// in flight on the connection, and none can start.
	mu         sync.RWMutex
	closed     bool
	savepoints int // nested transactions started, for unique savepoint names

	loOnce sync.Once
	lo     pgx.Tx // a pgx Tx on the same connection, only for LargeObjects
}

var _ pgx.Tx = (*callTx)(nil)

// close ends the handler's use of the transaction, when its Func returns.
func (t *callTx) close() {
	t.mu.Lock()
	t.closed = true
	t.mu.Unlock()
}

// use holds the transaction open for one statement; done must be called
// after it. ok is false once the call is over.
func (t *callTx) use() (done func(), ok bool) {
	t.mu.RLock()
	if t.closed {
		t.mu.RUnlock()
		return nil, false
	}
	return t.mu.RUnlock, true
}

func (t *callTx) Begin(ctx context.Context) (pgx.Tx, error) {
	done, ok := t.use()
	if !ok {
		return nil, pgx.ErrTxClosed
	}
	defer done()
	return beginSavepoint(ctx, t, t)
}

func (t *callTx) Commit(context.Context) error {
	done, ok := t.use()
	if !ok {
		return pgx.ErrTxClosed
	}
	defer done()
	return ErrTxOwned
}

func (t *callTx) Rollback(context.Context) error {
	done, ok := t.use()
	if !ok {
		return pgx.ErrTxClosed
	}
	defer done()
	return ErrTxOwned
}

func (t *callTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	done, ok := t.use()
	if !ok {
		return 0, pgx.ErrTxClosed
	}
	defer done()
	return t.conn.CopyFrom(ctx, table, cols, src)
}

func (t *callTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	done, ok := t.use()
	if !ok {
		return closedBatch{}
	}
	defer done()
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
	done, ok := t.use()
	if !ok {
		return nil, pgx.ErrTxClosed
	}
	defer done()
	return t.conn.Prepare(ctx, name, sql)
}

func (t *callTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	done, ok := t.use()
	if !ok {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	defer done()
	return t.conn.Exec(ctx, sql, args...)
}

func (t *callTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	done, ok := t.use()
	if !ok {
		return nil, pgx.ErrTxClosed
	}
	defer done()
	return t.conn.Query(ctx, sql, args...)
}

func (t *callTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	done, ok := t.use()
	if !ok {
		return closedRow{}
	}
	defer done()
	return t.conn.QueryRow(ctx, sql, args...)
}

// Conn returns the call's connection. Statements sent on it directly are
// in the call's transaction only while the call runs; Conn must not be used
// to begin, commit or roll back transactions.
func (t *callTx) Conn() *pgx.Conn { return t.conn }

// closedRow and closedBatch are what a dead call transaction returns.
type closedRow struct{}

func (closedRow) Scan(...any) error { return pgx.ErrTxClosed }

type closedBatch struct{}

func (closedBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, pgx.ErrTxClosed }
func (closedBatch) Query() (pgx.Rows, error)         { return nil, pgx.ErrTxClosed }
func (closedBatch) QueryRow() pgx.Row                { return closedRow{} }
func (closedBatch) Close() error                     { return pgx.ErrTxClosed }
func (closedBatch) Tx() pgx.Tx                       { return nil }

// savepointTx is a nested transaction inside a call's transaction, made
// with SAVEPOINT like pgx's own nested transactions.
type savepointTx struct {
	pgx.Tx // the enclosing transaction, for statements
	call   *callTx
	name   string
	closed bool
}

// beginSavepoint starts a nested transaction; its caller holds call.use.
func beginSavepoint(ctx context.Context, call *callTx, parent pgx.Tx) (pgx.Tx, error) {
	call.savepoints++
	name := "idempotency_sp_" + strconv.Itoa(call.savepoints)
	if _, err := call.conn.Exec(ctx, "SAVEPOINT "+name); err != nil {
		return nil, err
	}
	return &savepointTx{Tx: parent, call: call, name: name}, nil
}

func (s *savepointTx) Begin(ctx context.Context) (pgx.Tx, error) {
	done, ok := s.call.use()
	if s.closed || !ok {
		if ok {
			done()
		}
		return nil, pgx.ErrTxClosed
	}
	defer done()
	return beginSavepoint(ctx, s.call, s)
}

func (s *savepointTx) Commit(ctx context.Context) error {
	done, ok := s.call.use()
	if s.closed || !ok {
		if ok {
			done()
		}
		return pgx.ErrTxClosed
	}
	defer done()
	_, err := s.call.conn.Exec(ctx, "RELEASE SAVEPOINT "+s.name)
	s.closed = true
	return err
}

func (s *savepointTx) Rollback(ctx context.Context) error {
	done, ok := s.call.use()
	if s.closed || !ok {
		if ok {
			done()
		}
		return pgx.ErrTxClosed
	}
	defer done()
	_, err := s.call.conn.Exec(ctx, "ROLLBACK TO SAVEPOINT "+s.name)
	s.closed = true
	return err
}
