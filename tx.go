package idempotency

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// callTx is the transaction of one idempotent call, as handlers see it. The
// engine opens and ends it itself, pipelined with its own statements (BEGIN
// with the claim, the stored result with COMMIT), which pgx's own Tx cannot
// do; that saves two round trips per call. Handlers get everything but the
// right to end it:
//
//   - Commit and Rollback return [ErrTxOwned].
//   - SQL that would end or reshape the transaction (COMMIT, ROLLBACK,
//     BEGIN, SET TRANSACTION, and the others txControl lists) is refused
//     before it reaches PostgreSQL, with an error wrapping ErrTxOwned, and
//     the call then fails with codes.Internal, stored. This check is for
//     the error message only: a COMMIT that got past it (or was sent on
//     Conn) commits the key's claim with the handler's writes, and the key
//     never runs again all the same (see statements.claim).
//   - Rows and batch results left open when the handler returns are closed,
//     and the call fails the same way.
//   - Conn returns the connection itself, which is then closed when the
//     call ends, rather than returned to the pool (see Conn).
//
// Once the call is over the transaction is dead, as a pgx Tx is after its
// Commit: every method returns [pgx.ErrTxClosed], those of its savepoints
// and large objects too, so a handler that kept it cannot write into an
// idle pooled connection (autocommit) or into another call's transaction.
type callTx struct {
	conn    *pgx.Conn
	attempt *attempt
	// mu is held, shared, by each statement the handler sends, and taken
	// whole by close: once close returns, no statement of the handler's is
	// in flight on the connection, and none can start.
	mu     sync.RWMutex
	closed bool

	state      sync.Mutex // guards what follows, for handlers that share tx between goroutines
	savepoints int        // nested transactions started, for unique savepoint names
	refused    string     // why the call must fail, "" while nothing was refused
	// The rows and batch results handed out, closed when the call ends.
	rows    []pgx.Rows
	batches []pgx.BatchResults
	config  *pgxpool.Config // Config's copy, made at its first use
	// downstream is what the run's downstream keys derive from (see
	// EffectKey): here rather than in a value of its own, so that a
	// call that derives none allocates nothing for them.
	downstream downstream
}

var _ pgx.Tx = (*callTx)(nil)

// close ends the handler's use of the transaction, when its Func returns:
// it closes what the handler left open, so that the engine can use the
// connection, and notes that it did.
func (t *callTx) close() {
	t.mu.Lock()
	t.closed = true
	t.mu.Unlock()
	t.state.Lock()
	defer t.state.Unlock()
	leftOpen := !t.conn.IsClosed() && t.conn.PgConn().IsBusy()
	for _, r := range t.rows {
		r.Close()
	}
	for _, b := range t.batches {
		_ = b.Close()
	}
	if leftOpen && t.refused == "" {
		t.refused = "idempotency: the handler returned while the rows of one of its queries (or the results of a batch) were still open; " +
			"pgx needs them closed before the connection can run anything else. Close them (defer rows.Close()), or read them to the end. " +
			"The key is kept with this error so that the call does not run again"
	}
}

// ended reports whether the handler has returned: the call's context may
// outlive it, its transaction and its keys may not.
func (t *callTx) ended() bool {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.closed
}

// refusal is why the call must fail, "" when it need not.
func (t *callTx) refusal() string {
	t.state.Lock()
	defer t.state.Unlock()
	return t.refused
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

// ErrTxOwned is returned by Commit and Rollback on the transaction a
// handler gets from [TxFromContext], and wrapped in the error of a
// statement sent through it that would end the transaction: the call's
// outcome decides them.
var ErrTxOwned = errors.New("idempotency: the transaction belongs to the idempotent call; return an error to roll it back")

// allow refuses SQL that would end or reshape the call's transaction. The
// first refusal decides the call's outcome, whatever the handler does next.
// Its caller holds t.use.
func (t *callTx) allow(ctx context.Context, sql string) error {
	if t.conn.PgConn().TxStatus() == 'I' {
		// The call's transaction has ended (a COMMIT or ROLLBACK got
		// through): what the handler sends now would commit on its own,
		// outside the call. A fact of the protocol, not of the SQL.
		return t.refuseEnded()
	}
	if t.attempt.s.opts.noSQLCheck {
		return nil
	}
	v := checkedSQL(sql)
	what := v.what
	if v.preparedName != "" {
		what = t.preparedStatement(ctx, v.preparedName)
	}
	if what == "" {
		return nil
	}
	return t.refuse(what)
}

// resetSession notes that the handler left what on the session, which the
// engine does not reset, so that the connection is closed when the call
// ends.
func (t *callTx) resetSession(what string) {
	t.state.Lock()
	defer t.state.Unlock()
	if t.attempt.reset == "" {
		t.attempt.reset = "the handler left " + what + " on the session"
	}
}

// refuse answers a statement that would end or reshape the call's
// transaction, what, and makes the call fail.
func (t *callTx) refuse(what string) error {
	err := fmt.Errorf("%w: %s refused; it would end or change the call's transaction, which commits with the call's result "+
		"(nested transactions: tx.Begin; the isolation level: the store's or the method's setting)", ErrTxOwned, what)
	t.state.Lock()
	defer t.state.Unlock()
	if t.refused == "" {
		t.refused = "idempotency: the handler sent " + what + " through the call's transaction, which the engine refused: " +
			"a handler must not end the transaction, which commits with the call's result, nor change it. " +
			"Nothing it wrote was committed; the key is kept with this error so that the call does not run again"
	}
	return err
}

// refuseEnded answers a statement sent after the call's transaction
// ended, and makes the call fail.
func (t *callTx) refuseEnded() error {
	t.state.Lock()
	defer t.state.Unlock()
	if t.refused == "" {
		t.refused = "idempotency: the handler ended the call's transaction itself, then sent more statements through it, which the engine " +
			"refused: they would have committed outside the call. The key is kept with this error so that the call does not run again"
	}
	return fmt.Errorf("%w: the call's transaction has ended; the statement was not sent", ErrTxOwned)
}

// checkedSQL is txControl, remembered for the statements a process sends
// again and again (most handlers' SQL is
// constant), up to a bound, so that SQL built afresh for each call cannot
// grow it.
func checkedSQL(sql string) sqlVerdict {
	if v, ok := checked.Load(sql); ok {
		return v.(sqlVerdict)
	}
	var v sqlVerdict
	v.what, v.preparedName = txControl(sql)
	if checkedCount.Load() < maxChecked && len(sql) <= maxCheckedLen {
		if _, loaded := checked.LoadOrStore(sql, v); !loaded {
			checkedCount.Add(1)
		}
	}
	return v
}

// sqlVerdict is what checkedSQL finds in a statement: what of it would end
// or reshape the call's transaction, and the name of the prepared statement
// it may be.
type sqlVerdict struct{ what, preparedName string }

var (
	checked      sync.Map // SQL text -> sqlVerdict
	checkedCount atomic.Int64
)

const (
	maxChecked    = 4096
	maxCheckedLen = 4096
)

// preparedStatement checks the statement prepared on the connection under
// name, which pgx runs when given its name as SQL: what txControl refuses
// of its SQL, "" when it may run (or when no statement has that name, and
// PostgreSQL will read name as SQL).
func (t *callTx) preparedStatement(ctx context.Context, name string) string {
	var sql string
	err := t.conn.QueryRow(ctx, `SELECT statement FROM pg_catalog.pg_prepared_statements WHERE name = $1`, pgx.QueryExecModeSimpleProtocol, name).Scan(&sql)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return ""
	case err != nil:
		return "the prepared statement " + name + " (its SQL could not be checked: " + err.Error() + ")"
	}
	if v := checkedSQL(sql); v.what != "" {
		return v.what + " (as the prepared statement " + name + ")"
	}
	return ""
}

// trackRows and trackBatch keep a result handed to the handler, to close
// it when the call ends.
func (t *callTx) trackRows(rows pgx.Rows) {
	t.state.Lock()
	t.rows = append(t.rows, rows)
	t.state.Unlock()
}

func (t *callTx) trackBatch(br pgx.BatchResults) {
	t.state.Lock()
	t.batches = append(t.batches, br)
	t.state.Unlock()
}

func (t *callTx) Begin(ctx context.Context) (pgx.Tx, error) {
	done, ok := t.use()
	if !ok {
		return nil, pgx.ErrTxClosed
	}
	defer done()
	return t.beginSavepoint(ctx)
}

func (t *callTx) Commit(context.Context) error {
	done, ok := t.use()
	if !ok {
		return pgx.ErrTxClosed
	}
	done()
	return ErrTxOwned
}

func (t *callTx) Rollback(context.Context) error {
	done, ok := t.use()
	if !ok {
		return pgx.ErrTxClosed
	}
	done()
	return ErrTxOwned
}

func (t *callTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	return t.copyFrom(ctx, nil, table, cols, src)
}

func (t *callTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return t.sendBatch(ctx, nil, b)
}

func (t *callTx) LargeObjects() pgx.LargeObjects { return largeObjectsOf(t) }

func (t *callTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	return t.prepare(ctx, nil, name, sql)
}

func (t *callTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return t.exec(ctx, nil, sql, args)
}

func (t *callTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return t.query(ctx, nil, sql, args)
}

func (t *callTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return t.queryRow(ctx, nil, sql, args)
}

// Conn returns the call's connection. Statements sent on it directly are in
// the call's transaction only while the call runs, and are not checked:
// Conn must not be used to begin, commit or roll back transactions. Should
// a handler do so all the same, the key stays safe: the claim commits with
// whatever a COMMIT commits, and the key's lock, held by the session,
// outlives a ROLLBACK; the call then fails with codes.Internal, stored. The
// connection is closed when the call ends, rather than returned to the
// pool, so that nothing the handler kept of it (or changed in its session)
// can reach a later call: a call that uses Conn costs a new connection
// afterwards. The Conn of the call's rows (pgx.Rows.Conn) is this one. A
// library that calls Conn only to read the connection's settings pays the
// same; a library that needs only the settings can read them from Config,
// which River's pgx driver does, so River's InsertTx works on the call's
// transaction as it is.
//
// Conn called once the call is over (by a goroutine the handler left
// behind) cannot be refused, and the connection may be serving another call
// by then: it closes the connection's socket first, so that nothing sent on
// it reaches that call (which fails with Unavailable, nothing committed).
func (t *callTx) Conn() *pgx.Conn {
	done, ok := t.use()
	if !ok {
		_ = t.conn.PgConn().Conn().Close()
		return t.conn
	}
	defer done()
	t.handOut()
	return t.conn
}

// Config returns the configuration of the pool the call's connection came
// from, for code that needs the connection's settings (its query mode, its
// type map) without the connection itself: River's pgx driver reads its
// query mode from a Config method before it falls back on Conn. It is
// the call's own copy: what the handler changes in it changes nothing
// else. Reading it neither hands out the connection nor costs it.
func (t *callTx) Config() *pgxpool.Config {
	t.state.Lock()
	defer t.state.Unlock()
	if t.config == nil {
		t.config = t.attempt.s.poolConfig(t.conn).Copy()
	}
	return t.config
}

// handOut notes that the handler has the connection itself, which the
// attempt then closes when it ends. Its caller holds t.use.
func (t *callTx) handOut() {
	t.state.Lock()
	t.attempt.rawConn = true
	t.state.Unlock()
}

// The statements of the call's transaction and of its savepoints: each
// takes the call's hold, refuses once the call (or the savepoint, closed)
// is over, and checks its SQL.

func (t *callTx) exec(ctx context.Context, closed *atomic.Bool, sql string, args []any) (pgconn.CommandTag, error) {
	done, ok := t.use()
	if !ok || isClosed(closed) {
		release(done)
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	defer done()
	if err := t.allow(ctx, sql); err != nil {
		return pgconn.CommandTag{}, err
	}
	return t.conn.Exec(ctx, sql, t.checkRewriters(args)...)
}

func (t *callTx) query(ctx context.Context, closed *atomic.Bool, sql string, args []any) (pgx.Rows, error) {
	done, ok := t.use()
	if !ok || isClosed(closed) {
		release(done)
		return nil, pgx.ErrTxClosed
	}
	defer done()
	if err := t.allow(ctx, sql); err != nil {
		return nil, err
	}
	rows, err := t.conn.Query(ctx, sql, t.checkRewriters(args)...)
	if rows == nil {
		return nil, err
	}
	t.trackRows(rows)
	return &callRows{Rows: rows, tx: t}, err
}

// callRows are rows of the call's transaction: their Conn is the
// transaction's, with what that costs (see callTx.Conn).
type callRows struct {
	pgx.Rows
	tx *callTx
}

func (r *callRows) Conn() *pgx.Conn { return r.tx.Conn() }

// checkRewriters wraps the query rewriters among a statement's leading
// options (pgx.NamedArgs, say), so that the SQL they produce is checked as
// the SQL they were given is. The options pgx reads before the arguments
// are skipped, in any order.
func (t *callTx) checkRewriters(args []any) []any {
	args, _ = t.checkedRewriters(args)
	return args
}

// checkedRewriters is checkRewriters, and reports whether it wrapped any.
func (t *callTx) checkedRewriters(args []any) (_ []any, copied bool) {
	for i := 0; i < len(args); i++ {
		switch arg := args[i].(type) {
		case pgx.QueryExecMode, pgx.QueryResultFormats, pgx.QueryResultFormatsByOID:
			continue
		case pgx.QueryRewriter:
			if !copied { // the caller's slice stays as it was
				args, copied = append([]any(nil), args...), true
			}
			args[i] = checkedRewriter{inner: arg, tx: t}
			continue
		}
		break
	}
	return args, copied
}

// checkedRewriter checks the SQL a query rewriter makes.
type checkedRewriter struct {
	inner pgx.QueryRewriter
	tx    *callTx
}

func (r checkedRewriter) RewriteQuery(ctx context.Context, conn *pgx.Conn, sql string, args []any) (string, []any, error) {
	sql, args, err := r.inner.RewriteQuery(ctx, conn, sql, args)
	if err == nil {
		err = r.tx.allow(ctx, sql)
	}
	return sql, args, err
}

func (t *callTx) queryRow(ctx context.Context, closed *atomic.Bool, sql string, args []any) pgx.Row {
	rows, err := t.query(ctx, closed, sql, args)
	return &row{rows: rows, err: err}
}

func (t *callTx) sendBatch(ctx context.Context, closed *atomic.Bool, b *pgx.Batch) pgx.BatchResults {
	done, ok := t.use()
	if !ok || isClosed(closed) {
		release(done)
		return closedBatch{pgx.ErrTxClosed}
	}
	defer done()
	for _, q := range b.QueuedQueries {
		if err := t.allow(ctx, q.SQL); err != nil {
			return closedBatch{err}
		}
	}
	if t.attempt.s.simpleProtocol.Load() && len(b.QueuedQueries) > 1 {
		// pgx joins the statements into one string, which may read as
		// other statements than each alone.
		sqls := make([]string, len(b.QueuedQueries))
		for i, q := range b.QueuedQueries {
			sqls[i] = q.SQL
		}
		if err := t.allow(ctx, strings.Join(sqls, "\n;")); err != nil {
			return closedBatch{err}
		}
	}
	br := t.conn.SendBatch(ctx, t.checkedBatch(b))
	t.trackBatch(br)
	return &callBatch{BatchResults: br, tx: t}
}

// checkedBatch is b as sent through the call's transaction: a copy, when
// it needs changing, whose query rewriters are checked (see
// checkRewriters) and whose callbacks get the call's rows, whose Conn is
// the call's (pgx hands them rows of its own).
func (t *callTx) checkedBatch(b *pgx.Batch) *pgx.Batch {
	var c *pgx.Batch
	for i, q := range b.QueuedQueries {
		args, wrapped := t.checkedRewriters(q.Arguments)
		if q.Fn == nil && !wrapped {
			continue
		}
		if c == nil {
			c = &pgx.Batch{QueuedQueries: make([]*pgx.QueuedQuery, len(b.QueuedQueries))}
			copy(c.QueuedQueries, b.QueuedQueries)
		}
		qc := *q
		qc.Arguments = args
		if fn := q.Fn; fn != nil {
			qc.Fn = func(br pgx.BatchResults) error { return fn(&callBatch{BatchResults: br, tx: t}) }
		}
		c.QueuedQueries[i] = &qc
	}
	if c == nil {
		return b
	}
	return c
}

// callBatch is the results of a batch sent through the call's
// transaction: its rows are the call's (see callRows).
type callBatch struct {
	pgx.BatchResults
	tx *callTx
}

func (b *callBatch) Query() (pgx.Rows, error) {
	rows, err := b.BatchResults.Query()
	if rows == nil {
		return nil, err
	}
	return &callRows{Rows: rows, tx: b.tx}, err
}

func (t *callTx) prepare(ctx context.Context, closed *atomic.Bool, name, sql string) (*pgconn.StatementDescription, error) {
	done, ok := t.use()
	if !ok || isClosed(closed) {
		release(done)
		return nil, pgx.ErrTxClosed
	}
	defer done()
	if err := t.allow(ctx, sql); err != nil {
		return nil, err
	}
	if name != "" {
		// A named prepared statement outlives the call on its session, and
		// pgx keeps it under that name.
		t.resetSession("a statement prepared as " + strconv.Quote(name))
	}
	return t.conn.Prepare(ctx, name, sql)
}

func (t *callTx) copyFrom(ctx context.Context, closed *atomic.Bool, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	done, ok := t.use()
	if !ok || isClosed(closed) {
		release(done)
		return 0, pgx.ErrTxClosed
	}
	defer done()
	if t.conn.PgConn().TxStatus() == 'I' {
		return 0, t.refuseEnded()
	}
	return t.conn.CopyFrom(ctx, table, cols, src)
}

// isClosed reports whether a savepoint's closed flag is set; nil is the
// call's transaction itself, which use checks.
func isClosed(closed *atomic.Bool) bool { return closed != nil && closed.Load() }

// release calls done when it is set: a hold that was taken.
func release(done func()) {
	if done != nil {
		done()
	}
}

// row is what QueryRow returns: pgx's semantics (ErrNoRows, the rows closed
// after Scan), on rows the call tracks.
type row struct {
	rows pgx.Rows
	err  error
}

func (r *row) Scan(dest ...any) error {
	if r.err != nil {
		return r.err
	}
	defer r.rows.Close()
	if !r.rows.Next() {
		if err := r.rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := r.rows.Scan(dest...); err != nil {
		return err
	}
	r.rows.Close()
	return r.rows.Err()
}

// closedBatch is the result of a batch that was not sent.
type closedBatch struct{ err error }

func (b closedBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, b.err }
func (b closedBatch) Query() (pgx.Rows, error)         { return nil, b.err }
func (b closedBatch) QueryRow() pgx.Row                { return &row{err: b.err} }
func (b closedBatch) Close() error                     { return b.err }
func (b closedBatch) Tx() pgx.Tx                       { return nil }

// savepointTx is a nested transaction inside a call's transaction, made
// with SAVEPOINT like pgx's own nested transactions. Once committed or
// rolled back it is closed, as pgx's are, and so is it once the call is
// over.
type savepointTx struct {
	call   *callTx
	name   string
	closed atomic.Bool
}

var _ pgx.Tx = (*savepointTx)(nil)

// beginSavepoint starts a nested transaction; its caller holds t.use.
func (t *callTx) beginSavepoint(ctx context.Context) (pgx.Tx, error) {
	t.state.Lock()
	t.savepoints++
	name := "idempotency_sp_" + strconv.Itoa(t.savepoints)
	t.state.Unlock()
	if _, err := t.conn.Exec(ctx, "SAVEPOINT "+name); err != nil {
		return nil, err
	}
	return &savepointTx{call: t, name: name}, nil
}

func (s *savepointTx) Begin(ctx context.Context) (pgx.Tx, error) {
	done, ok := s.call.use()
	if !ok || s.closed.Load() {
		release(done)
		return nil, pgx.ErrTxClosed
	}
	defer done()
	return s.call.beginSavepoint(ctx)
}

func (s *savepointTx) Commit(ctx context.Context) error { return s.end(ctx, "RELEASE SAVEPOINT ") }

func (s *savepointTx) Rollback(ctx context.Context) error {
	return s.end(ctx, "ROLLBACK TO SAVEPOINT ")
}

// end releases or rolls back the savepoint, and closes s.
func (s *savepointTx) end(ctx context.Context, statement string) error {
	done, ok := s.call.use()
	if !ok || !s.closed.CompareAndSwap(false, true) {
		release(done)
		return pgx.ErrTxClosed
	}
	defer done()
	_, err := s.call.conn.Exec(ctx, statement+s.name)
	return err
}

func (s *savepointTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	return s.call.copyFrom(ctx, &s.closed, table, cols, src)
}

func (s *savepointTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return s.call.sendBatch(ctx, &s.closed, b)
}

func (s *savepointTx) LargeObjects() pgx.LargeObjects { return largeObjectsOf(s) }

func (s *savepointTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	return s.call.prepare(ctx, &s.closed, name, sql)
}

func (s *savepointTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return s.call.exec(ctx, &s.closed, sql, args)
}

func (s *savepointTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return s.call.query(ctx, &s.closed, sql, args)
}

func (s *savepointTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return s.call.queryRow(ctx, &s.closed, sql, args)
}

// Conn is the call's connection; see callTx.Conn.
func (s *savepointTx) Conn() *pgx.Conn { return s.call.Conn() }

// Config is the call's (see callTx.Config).
func (s *savepointTx) Config() *pgxpool.Config { return s.call.Config() }
