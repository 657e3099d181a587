package idempotency_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// A handler cut short by the caller's deadline: DeadlineExceeded, nothing
// committed, the key free. The deadline passes while the handler's
// statement runs in PostgreSQL, whatever the machine's speed.
func TestHandlerPastItsDeadline(t *testing.T) {
	t.Parallel()
	var e *env
	var outcome atomic.Value
	var pid atomic.Uint32 // the backend running the handler's statement
	sleep := func(ctx context.Context, tx pgx.Tx) error {
		var p uint32 // through tx: a handler that touches tx.Conn() is held to a stricter rule
		if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&p); err != nil {
			return err
		}
		pid.Store(p)
		_, err := tx.Exec(ctx, `SELECT pg_sleep(60)`)
		return err
	}
	var cue *deadlineCue
	e = newEnv(t, envConfig{
		handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			if _, err := e.insertLedger(ctx, req); err != nil {
				return nil, err
			}
			return wrapperspb.String("late"), sleep(ctx, idempotency.MustTxFromContext(ctx))
		},
		tracer: endTracer(func(_ context.Context, data idempotency.TraceCallEndData) {
			outcome.Store([2]any{data.Outcome, status.Code(data.Err)})
		}),
		// A server-side timeout, as a handler-timeout middleware sets one.
		interceptors: []grpc.UnaryServerInterceptor{func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			return h(cue.wrap(ctx), req)
		}},
	})
	cue = newDeadlineCue()
	replied := make(chan reply, 1)
	go func() { replied <- e.call(context.Background(), methodCharge, "k", "x") }()
	cue.expireWhenSleeping(t, e.db, &pid)
	r := await(t, replied, "the call")
	require.Equal(t, codes.DeadlineExceeded, status.Code(r.err), "%v", r.err)
	require.Eventually(t, func() bool { return outcome.Load() != nil }, liveness, 5*time.Millisecond)
	require.Equal(t, [2]any{idempotency.OutcomeReleased, codes.DeadlineExceeded}, outcome.Load(), "the server reports the deadline, not an outage")
	require.Equal(t, 0, e.ledgerRows())
	require.Equal(t, 0, e.keyRows())

	// The same through the engine.
	pid.Store(0)
	cue = newDeadlineCue()
	type executed struct {
		res idempotency.Result
		err error
	}
	done := make(chan executed, 1)
	go func() {
		res, err := e.store.Execute(cue.wrap(context.Background()), idempotency.Call{Key: "k2", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			return nil, sleep(ctx, tx)
		})
		done <- executed{res, err}
	}()
	cue.expireWhenSleeping(t, e.db, &pid)
	x := await(t, done, "Execute")
	require.ErrorIs(t, x.err, context.DeadlineExceeded)
	require.Equal(t, codes.DeadlineExceeded, status.Code(x.err))
	require.Equal(t, idempotency.OutcomeReleased, x.res.Outcome)
}

func TestPanicRollsBackAndLeavesNoKey(t *testing.T) {
	t.Parallel()
	var e *env
	e = newEnv(t, envConfig{
		interceptors: []grpc.UnaryServerInterceptor{recovery.UnaryServerInterceptor()},
		handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			resp, err := e.insertLedger(ctx, req)
			if e.runs.Load() == 1 {
				panic("handler bug")
			}
			return resp, err
		},
	})
	r := e.call(context.Background(), methodCharge, "k", "x")
	require.ErrorContains(t, r.err, "panic caught", "the panic propagated to the recovery interceptor")
	require.Equal(t, 0, e.ledgerRows())
	require.Equal(t, 0, e.keyRows())

	requireNoKeyLocks(t, e.db, "", []string{"k"}, "no lock outlives the panicking call")
	r = e.call(context.Background(), methodCharge, "k", "x")
	require.NoError(t, r.err)
	require.False(t, r.replayed)
}
