package idempotency_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// policyServer implements every method of the annotated test service the
// same way: one ledger row per execution, through the call's transaction
// when there is one.
type policyServer struct {
	testingv1.UnimplementedPolicyServiceServer
	db *testdb.DB
}

func (s *policyServer) write(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
	var id int64
	q := `INSERT INTO ledger (note) VALUES ($1) RETURNING id`
	var err error
	if tx, ok := idempotency.TxFromContext(ctx); ok {
		err = tx.QueryRow(ctx, q, req.GetBody()).Scan(&id)
	} else {
		err = s.db.Pool.QueryRow(ctx, q, req.GetBody()).Scan(&id)
	}
	return &testingv1.Response{Body: req.GetBody(), LedgerId: id}, err
}

func (s *policyServer) Required(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) Optional(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) Disabled(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) NoSideEffects(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) Idempotent(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) RequiredDespiteLevel(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) Unannotated(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) NaturalKey(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) ShortTTL(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) BadKeyField(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) NonStringKeyField(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}

// Serializable answers with the isolation level of its transaction.
func (s *policyServer) Serializable(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	resp, err := s.write(ctx, r)
	if err == nil {
		err = idempotency.MustTxFromContext(ctx).QueryRow(ctx, `SELECT current_setting('transaction_isolation')`).Scan(&resp.Body)
	}
	return resp, err
}

type policyEnv struct {
	db     *testdb.DB
	client testingv1.PolicyServiceClient
}

func newPolicyEnv(t *testing.T, opts ...idempotency.ServerOption) *policyEnv {
	t.Helper()
	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	createLedger(t, db)
	srv := grpc.NewServer(grpc.UnaryInterceptor(idempotency.UnaryServerInterceptor(store, opts...)))
	testingv1.RegisterPolicyServiceServer(srv, &policyServer{db: db})
	return &policyEnv{db: db, client: testingv1.NewPolicyServiceClient(dial(t, serve(t, srv)))}
}

type rpc func(context.Context, *testingv1.Request, ...grpc.CallOption) (*testingv1.Response, error)

// send calls m with key in the metadata (none when empty) and reports the
// response, whether it was replayed, and the error.
func send(m rpc, key string, req *testingv1.Request) (*testingv1.Response, bool, error) {
	ctx := context.Background()
	if key != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, key)
	}
	var tr metadata.MD
	resp, err := m(ctx, req, grpc.Trailer(&tr))
	return resp, len(tr.Get(idempotency.ReplayedTrailer)) > 0, err
}

func badRequestField(t *testing.T, err error) string {
	t.Helper()
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	for _, d := range status.Convert(err).Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			return br.GetFieldViolations()[0].GetField()
		}
	}
	t.Fatalf("no BadRequest detail in %v", err)
	return ""
}

func TestPolicyFromProtoOptions(t *testing.T) {
	t.Parallel()
	e := newPolicyEnv(t)
	c := e.client
	req := func(body string) *testingv1.Request { return &testingv1.Request{Body: body} }
	keyRows := func(key string) int {
		return e.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = $1`, key)
	}

	t.Run("required: a call without a key is rejected, naming the metadata key", func(t *testing.T) {
		_, _, err := send(c.Required, "", req("r"))
		require.Equal(t, idempotency.MetadataKey, badRequestField(t, err))
		require.Equal(t, 0, e.db.Count(t, `SELECT count(*) FROM ledger WHERE note = 'r'`))
		first, _, err := send(c.Required, "req-key", req("r"))
		require.NoError(t, err)
		again, replayed, err := send(c.Required, "req-key", req("r"))
		require.NoError(t, err)
		require.True(t, replayed)
		require.Equal(t, first.GetLedgerId(), again.GetLedgerId())
	})

	t.Run("the explicit option wins over idempotency_level", func(t *testing.T) {
		_, _, err := send(c.RequiredDespiteLevel, "", req("rl"))
		require.Equal(t, idempotency.MetadataKey, badRequestField(t, err))
	})

	t.Run("isolation: the method's transaction runs at its level", func(t *testing.T) {
		resp, _, err := send(c.Serializable, "ser-key", req("s"))
		require.NoError(t, err)
		require.Equal(t, "serializable", resp.GetBody(), "on a database whose default is READ COMMITTED")
	})

	t.Run("optional: no key passes through, a key protects", func(t *testing.T) {
		_, replayed, err := send(c.Optional, "", req("o"))
		require.NoError(t, err)
		require.False(t, replayed)
		first, _, err := send(c.Optional, "opt-key", req("o"))
		require.NoError(t, err)
		again, replayed, err := send(c.Optional, "opt-key", req("o"))
		require.NoError(t, err)
		require.True(t, replayed)
		require.Equal(t, first.GetLedgerId(), again.GetLedgerId())
		require.Equal(t, 2, e.db.Count(t, `SELECT count(*) FROM ledger WHERE note = 'o'`))
	})

	for name, m := range map[string]rpc{
		"MODE_DISABLED":   c.Disabled,
		"NO_SIDE_EFFECTS": c.NoSideEffects,
		"IDEMPOTENT":      c.Idempotent,
	} {
		t.Run(name+": keys are ignored and every call runs", func(t *testing.T) {
			for _, key := range []string{"pass-key", "pass-key", "not a valid key"} {
				_, replayed, err := send(m, key, req(name))
				require.NoError(t, err)
				require.False(t, replayed)
			}
			require.Equal(t, 3, e.db.Count(t, `SELECT count(*) FROM ledger WHERE note = $1`, name))
			require.Equal(t, 0, keyRows("pass-key"))
		})
	}

	t.Run("key_field: the request's nested field is the key", func(t *testing.T) {
		natural := func(id string) *testingv1.Request {
			return &testingv1.Request{Body: "n", Meta: &testingv1.Meta{RequestId: id}}
		}
		first, replayed, err := send(c.NaturalKey, "", natural("order-7"))
		require.NoError(t, err)
		require.False(t, replayed)
		again, replayed, err := send(c.NaturalKey, "", natural("order-7"))
		require.NoError(t, err)
		require.True(t, replayed)
		require.Equal(t, first.GetLedgerId(), again.GetLedgerId())
		require.Equal(t, 1, keyRows("order-7"))

		_, _, err = send(c.NaturalKey, "", &testingv1.Request{Body: "n"})
		require.Equal(t, "meta.request_id", badRequestField(t, err), "unset message on the path")
		_, _, err = send(c.NaturalKey, "", natural(""))
		require.Equal(t, "meta.request_id", badRequestField(t, err), "empty field")
		_, _, err = send(c.NaturalKey, "", natural("has space"))
		require.Equal(t, "meta.request_id", badRequestField(t, err), "invalid key in the field")

		_, _, err = send(c.NaturalKey, "md-key", natural("order-8"))
		require.NoError(t, err)
		require.Equal(t, 1, keyRows("md-key"), "the metadata key wins over the field")
		require.Equal(t, 0, keyRows("order-8"))
	})

	t.Run("ttl: the method's TTL overrides the interceptor's", func(t *testing.T) {
		_, _, err := send(c.ShortTTL, "ttl-key", req("t"))
		require.NoError(t, err)
		var ttl time.Duration
		require.NoError(t, e.db.Pool.QueryRow(context.Background(),
			`SELECT expires_at - created_at FROM idempotency_keys WHERE key = 'ttl-key'`).Scan(&ttl))
		// 200 ms, the method's, not the interceptor's 24 hours; more when
		// the commit took half of it and the TTL counts from its end.
		require.GreaterOrEqual(t, ttl, 200*time.Millisecond)
		require.Less(t, ttl, time.Hour)
		require.Eventually(t, func() bool {
			return e.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'ttl-key' AND expires_at <= now()`) == 1
		}, liveness, 10*time.Millisecond, "the key to expire")
		_, replayed, err := send(c.ShortTTL, "ttl-key", req("t"))
		require.NoError(t, err)
		require.False(t, replayed, "expired after the method's TTL")
	})

	t.Run("a misconfigured option fails every call with Internal", func(t *testing.T) {
		for _, m := range []rpc{c.BadKeyField, c.NonStringKeyField} {
			for _, key := range []string{"", "cfg-key"} {
				_, _, err := send(m, key, req("bad"))
				require.Equal(t, codes.Internal, status.Code(err), "%v", err)
				require.ErrorContains(t, err, "key_field")
			}
		}
		require.Equal(t, 0, e.db.Count(t, `SELECT count(*) FROM ledger WHERE note = 'bad'`))
	})
}

func TestPolicyDefaultsForUnannotatedMethods(t *testing.T) {
	t.Parallel()
	loose := newPolicyEnv(t)
	_, _, err := send(loose.client.Unannotated, "", &testingv1.Request{Body: "u"})
	require.NoError(t, err, "without WithKeyRequired an unannotated method passes through")

	strict := newPolicyEnv(t, idempotency.WithKeyRequired(), idempotency.WithTTL(time.Hour))
	_, _, err = send(strict.client.Unannotated, "", &testingv1.Request{Body: "u"})
	require.Equal(t, idempotency.MetadataKey, badRequestField(t, err))
	_, _, err = send(strict.client.Optional, "", &testingv1.Request{Body: "u"})
	require.NoError(t, err, "an explicit MODE_OPTIONAL wins over WithKeyRequired")
	_, _, err = send(strict.client.Unannotated, "k", &testingv1.Request{Body: "u"})
	require.NoError(t, err)
	var ttl time.Duration
	require.NoError(t, strict.db.Pool.QueryRow(context.Background(),
		`SELECT expires_at - created_at FROM idempotency_keys WHERE key = 'k'`).Scan(&ttl))
	require.Equal(t, time.Hour, ttl, "the interceptor's TTL applies without a method TTL")
}

// The client reads the same descriptors: keys where the method needs one,
// none for natural keys, disabled methods or safe levels.
func TestClientFollowsProtoOptions(t *testing.T) {
	t.Parallel()
	icpt := idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1))
	svc := "/" + testingv1.PolicyService_ServiceDesc.ServiceName + "/"
	for method, want := range map[string]bool{
		"Required": true, "Optional": true, "Unannotated": true, "RequiredDespiteLevel": true, "ShortTTL": true,
		"Disabled": false, "NoSideEffects": false, "Idempotent": false, "NaturalKey": false,
	} {
		var sent []string
		err := icpt(context.Background(), svc+method, &testingv1.Request{}, &testingv1.Response{}, nil,
			func(ctx context.Context, _ string, _, _ any, _ *grpc.ClientConn, _ ...grpc.CallOption) error {
				sent = metadata.ValueFromOutgoingContext(ctx, idempotency.MetadataKey)
				return nil
			})
		require.NoError(t, err)
		require.Equal(t, want, len(sent) == 1, "%s: generated key %v", method, sent)
	}

	// A request that carries its own key: CaptureKey reports that key.
	var captured string
	req := &testingv1.Request{Meta: &testingv1.Meta{RequestId: "req-7"}}
	err := icpt(context.Background(), svc+"NaturalKey", req, &testingv1.Response{}, nil,
		func(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error { return nil }, idempotency.CaptureKey(&captured))
	require.NoError(t, err)
	require.Equal(t, "req-7", captured)
}
