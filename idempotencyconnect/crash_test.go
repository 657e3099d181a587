package idempotencyconnect_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"testing"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/crashproc"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// crashChildEnv, when set to "<schema> <kill>", makes the test binary a
// connect server on the listening socket it inherits; with kill "kill" it
// kills itself with SIGKILL right after a call's transaction committed,
// before the response goes out.
const crashChildEnv = "IDEMPOTENCYCONNECT_CRASH_CHILD"

func serveCrashChild() error {
	var schema, kill string
	if _, err := fmt.Sscan(os.Getenv(crashChildEnv), &schema, &kill); err != nil {
		return fmt.Errorf("%s: %w", crashChildEnv, err)
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, (&testdb.DB{Schema: schema}).URL())
	if err != nil {
		return err
	}
	defer pool.Close()
	store, err := idempotency.NewStore(pool, idempotency.WithTracer(endTracer(func(_ context.Context, d idempotency.TraceCallEndData) {
		if kill == "kill" && d.Outcome == idempotency.OutcomeExecuted {
			crashproc.KillSelf() // committed, not answered
		}
	})))
	if err != nil {
		return err
	}
	mux, err := newHandlers(store, ledger)
	if err != nil {
		return err
	}
	lis, err := crashproc.Listener()
	if err != nil {
		return err
	}
	crashproc.Ready()
	return h2cServer(mux).Serve(lis)
}

// The server process dies with SIGKILL after a call's transaction
// committed and before its response went out; the client interceptor
// retries (Unavailable) with the call's key and reaches a new process,
// which has never run the method: it replays the committed response. One
// effect, in each protocol.
func TestServerKilledBetweenCommitAndAnswerLeavesOneEffect(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	store, err := idempotency.NewStore(db.Pool)
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, store.Migrate(ctx))
	_, err = db.Pool.Exec(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, body text NOT NULL)`)
	require.NoError(t, err)
	lis := listen(t)
	f, err := lis.(*net.TCPListener).File()
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.Close() })
	url := "http://" + lis.Addr().String()

	for i, p := range protocols {
		child := crashproc.Start(t, []string{crashChildEnv + "=" + db.Schema + " kill"}, f)
		done := make(chan *connect.Response[testingv1.Response], 1)
		errs := make(chan error, 1)
		go func() {
			resp, err := client(t, url, procRequired, p, false).CallUnary(ctx, connect.NewRequest(&testingv1.Request{Body: p.name}))
			errs <- err
			done <- resp
		}()
		child.RequireKilled(t, "after the commit, before the answer")
		replica := crashproc.Start(t, []string{crashChildEnv + "=" + db.Schema + " live"}, f)
		require.NoError(t, <-errs, p.name)
		resp := <-done
		require.Equal(t, "true", resp.Trailer().Get(idempotency.ReplayedTrailer), "%s: the retry was answered from the store", p.name)
		require.Equal(t, i+1, db.Count(t, `SELECT count(*) FROM ledger`), "%s: one effect", p.name)
		require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger WHERE id = $1 AND body = $2`, resp.Msg.GetLedgerId(), p.name), "%s: the response names the committed row", p.name)
		replica.Kill()
	}
}

// endTracer is an idempotency.Tracer that only looks at the end of each
// call.
type endTracer func(ctx context.Context, data idempotency.TraceCallEndData)

func (f endTracer) TraceCallStart(ctx context.Context, _ idempotency.TraceCallStartData) context.Context {
	return ctx
}

func (f endTracer) TraceCallEnd(ctx context.Context, data idempotency.TraceCallEndData) { f(ctx, data) }
