package idempotency_test

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// principal is what the authentication interceptor puts in the context.
type principal struct{}

// authenticate is a bearer-token interceptor of the kind the README puts
// before the idempotency interceptor.
func authenticate(tokens map[string]string) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		auth := metadata.ValueFromIncomingContext(ctx, "authorization")
		if len(auth) != 1 {
			return nil, status.Error(codes.Unauthenticated, "no credentials")
		}
		who, ok := tokens[strings.TrimPrefix(auth[0], "Bearer ")]
		if !ok {
			return nil, status.Error(codes.Unauthenticated, "unknown token")
		}
		return h(context.WithValue(ctx, principal{}, who), req)
	}
}

func scopeFromPrincipal(ctx context.Context) (string, error) {
	who, ok := ctx.Value(principal{}).(string)
	if !ok {
		return "", status.Error(codes.Unauthenticated, "no principal")
	}
	return who, nil
}

// A second caller who sends the first caller's key with the same request
// gets an execution of its own, never the first caller's stored response,
// and cannot even make the first caller's call wait: keys of different
// scopes never meet. (TestScopesIsolateCallers covers a scope read from
// metadata; this one takes it from an authentication interceptor, as the
// README says to.)
func TestStolenKeyGetsItsOwnExecution(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	holding := make(chan struct{})
	var e *env
	e = newEnv(t, envConfig{
		interceptors: []grpc.UnaryServerInterceptor{authenticate(map[string]string{"alice-token": "alice", "mallory-token": "mallory"})},
		opts:         []idempotency.ServerOption{idempotency.WithScope(scopeFromPrincipal)},
		storeOpts:    []idempotency.StoreOption{idempotency.WithInProgressWait(liveness)},
		handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			if req.GetValue() == "hold" {
				close(holding)
				select { // released by the test, or abandoned when it fails
				case <-release:
				case <-ctx.Done():
				}
			}
			return e.insertLedger(ctx, req)
		},
	})
	as := func(token, key string) context.Context {
		return metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+token, idempotency.MetadataKey, key)
	}

	alice := e.call(as("alice-token", "order-1"), methodCharge, "", "charge 100")
	require.NoError(t, alice.err)
	mallory := e.call(as("mallory-token", "order-1"), methodCharge, "", "charge 100")
	require.NoError(t, mallory.err)
	require.False(t, mallory.replayed, "the same key and request from another caller is executed, not replayed")
	require.NotEqual(t, alice.raw, mallory.raw, "the other caller never sees the first caller's response")
	require.Equal(t, 2, e.ledgerRows())

	for i := 0; i < 2; i++ {
		a := e.call(as("alice-token", "order-1"), methodCharge, "", "charge 100")
		m := e.call(as("mallory-token", "order-1"), methodCharge, "", "charge 100")
		require.True(t, a.replayed && m.replayed, "each caller's retry replays")
		require.Equal(t, alice.raw, a.raw, "alice replays her own response")
		require.Equal(t, mallory.raw, m.raw, "mallory replays her own response")
	}

	// While alice's call holds her key, mallory's call with the same key
	// neither waits for it nor gets Aborted.
	held := make(chan reply, 1)
	go func() { held <- e.call(as("alice-token", "order-2"), methodCharge, "", "hold") }()
	await(t, holding, "the first call's handler to run")
	// alice's call is released only after mallory's is answered: had it
	// held mallory's key, mallory's would have failed Aborted.
	m := e.call(as("mallory-token", "order-2"), methodCharge, "", "hold-not")
	require.NoError(t, m.err, "another caller's running call must not hold this caller's key")
	close(release)
	require.NoError(t, (<-held).err)

	r := e.call(as("eve-token", "order-1"), methodCharge, "", "charge 100")
	require.Equal(t, codes.Unauthenticated, status.Code(r.err))
	require.EqualValues(t, 4, e.runs.Load(), "handler runs: alice and mallory, twice each")
	require.Equal(t, 4, e.keyRows(), "one key per caller and call; none for the rejected caller")
}

// The default scope is one scope for every caller: a second caller who
// sends another caller's key with the same request gets that caller's
// stored response. This is the hazard the README's security section
// describes, and why servers with several callers set WithScope.
func TestDefaultScopeIsSharedByEveryCaller(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{interceptors: []grpc.UnaryServerInterceptor{authenticate(map[string]string{"alice-token": "alice", "mallory-token": "mallory"})}})
	as := func(token string) context.Context {
		return metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+token, idempotency.MetadataKey, "order-1")
	}
	alice := e.call(as("alice-token"), methodCharge, "", "charge 100")
	require.NoError(t, alice.err)
	mallory := e.call(as("mallory-token"), methodCharge, "", "charge 100")
	require.NoError(t, mallory.err)
	require.True(t, mallory.replayed)
	require.Equal(t, alice.raw, mallory.raw, "without WithScope, a key is shared by every caller")
	require.EqualValues(t, 1, e.runs.Load())
}

// An HTTP client that sends a predictable message ID as its key takes
// nothing from the message: keys of different transports never meet.
func TestHTTPKeyCannotSquatAMessageID(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, nil)
	ctx := context.Background()
	require.Equal(t, http.StatusCreated, e.post("order-7", "http charge").status)
	applied := 0
	for i := 0; i < 2; i++ {
		o, err := e.store.ProcessMessage(ctx, idempotency.Message{ID: "order-7", Body: []byte("message"), Redelivered: i > 0}, func(ctx context.Context, tx pgx.Tx) error {
			applied++
			_, err := tx.Exec(ctx, `INSERT INTO ledger (note, key) VALUES ('message effect', 'order-7')`)
			return err
		})
		require.NoError(t, err)
		require.Equal(t, []idempotency.Outcome{idempotency.OutcomeExecuted, idempotency.OutcomeReplayed}[i], o)
		require.Equal(t, idempotency.Ack, idempotency.DispositionOf(o, err))
	}
	require.Equal(t, 1, applied, "the message's effect happened, once")
	// And the other way round: a gRPC-style direct call with the same key.
	res, err := e.store.Execute(ctx, idempotency.Call{Key: "order-7", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil })
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
	require.Equal(t, http.StatusCreated, e.post("order-7", "http charge").status)
	rec, err := e.store.Inspect(ctx, "", "order-7")
	require.NoError(t, err)
	require.Equal(t, idempotency.TransportGRPC, rec.Transport, "Inspect looks among gRPC and direct calls first")
	require.Equal(t, 3, e.db.Count(t, `SELECT count(*) FROM idempotency_keys`))
}
