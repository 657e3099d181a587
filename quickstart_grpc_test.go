package idempotency_test

import (
	"context"
	"log"
	"log/slog"
	"net"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// verifyCaller stands for a service's own authentication interceptor.
func verifyCaller(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	auth := metadata.ValueFromIncomingContext(ctx, "authorization")
	if len(auth) != 1 {
		return nil, status.Error(codes.Unauthenticated, "no credentials")
	}
	who, ok := quickstartTokens[strings.TrimPrefix(auth[0], "Bearer ")]
	if !ok {
		return nil, status.Error(codes.Unauthenticated, "unknown caller")
	}
	return next(context.WithValue(ctx, callerKey{}, who), req)
}

// quickstartGRPCServer is the README's gRPC quickstart, server side.
func quickstartGRPCServer(ctx context.Context, pool *pgxpool.Pool) *grpc.Server {
	// The store: keys in your database, a log line per call (keys are not logged).
	store, err := idempotency.NewStore(pool, idempotency.WithTracer(idempotency.LogTracer(slog.Default())))
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil { // creates or updates the key table; cheap when up to date
		log.Fatal(err)
	}
	// Deletes expired keys (24 hours after their result) until ctx ends.
	go func() {
		_ = store.RunCleaner(ctx, time.Minute, 1000, func(err error) { slog.Error("idempotency cleaner", "err", err) })
	}()

	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
		verifyCaller, // yours, first: puts the verified caller in the context
		idempotency.UnaryServerInterceptor(store, idempotency.WithScope(verifiedCaller)),
	))
	// yourv1.RegisterYourServiceServer(srv, yourServer{})
	return srv
}

// quickstartGRPCClient is the README's gRPC quickstart, client side.
func quickstartGRPCClient(addr string, creds credentials.TransportCredentials) *grpc.ClientConn {
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(creds),
		// One key per call, kept for every retry; Unavailable, Aborted and
		// ResourceExhausted retried with backoff for up to 30 seconds.
		grpc.WithChainUnaryInterceptor(idempotency.UnaryClientInterceptor()),
	)
	if err != nil {
		log.Fatal(err)
	}
	return conn
}

// ledgerService is the service the gRPC quickstart's test registers: its
// Required method (MODE_REQUIRED in its .proto) writes a row through the
// call's transaction.
type ledgerService struct {
	testingv1.UnimplementedPolicyServiceServer
}

func (ledgerService) Required(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
	tx := idempotency.MustTxFromContext(ctx)
	resp := &testingv1.Response{Body: req.GetBody()}
	err := tx.QueryRow(ctx, `INSERT INTO ledger (body) VALUES ($1) RETURNING id`, req.GetBody()).Scan(&resp.LedgerId)
	return resp, err
}

// The gRPC quickstart, served over a socket: a call sent again with its key
// is replayed (one ledger row, the same answer, the replayed trailer), and
// the slog tracer writes a line for it that names the method and the
// outcome but not the key.
//
// Not parallel: it points slog's default logger, which the quickstart
// logs to, at a buffer, and parallel tests start only after it is done.
func TestQuickstartGRPCReplaysACall(t *testing.T) {
	var logs testdb.SyncBuffer
	prev, logOut, logFlags := slog.Default(), log.Writer(), log.Flags()
	slog.SetDefault(slog.New(slog.NewTextHandler(&logs, nil)))
	t.Cleanup(func() {
		// Restoring slog's default logger leaves log's output on the
		// buffer's handler; put it back too.
		slog.SetDefault(prev)
		log.SetOutput(logOut)
		log.SetFlags(logFlags)
	})

	db := testdb.New(t, 4)
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	_, err := db.Pool.Exec(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, body text)`)
	require.NoError(t, err)

	srv := quickstartGRPCServer(ctx, db.Pool)
	testingv1.RegisterPolicyServiceServer(srv, ledgerService{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()
	conn := quickstartGRPCClient(lis.Addr().String(), insecure.NewCredentials())
	defer conn.Close()
	client := testingv1.NewPolicyServiceClient(conn)

	alice := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer token-alice")
	var key string
	first, err := client.Required(alice, &testingv1.Request{Body: "transfer 500"}, idempotency.CaptureKey(&key))
	require.NoError(t, err)
	var trailer metadata.MD
	again, err := client.Required(idempotency.WithOutgoingKey(alice, key), &testingv1.Request{Body: "transfer 500"}, grpc.Trailer(&trailer))
	require.NoError(t, err)
	require.Equal(t, first.GetLedgerId(), again.GetLedgerId(), "the call sent again gets the first answer")
	require.Equal(t, []string{"true"}, trailer.Get(idempotency.ReplayedTrailer))
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`), "one row, however often the call is sent")

	var replayed string
	for _, line := range strings.Split(logs.String(), "\n") {
		if strings.Contains(line, "/idempotency.testing.v1.PolicyService/Required") && regexp.MustCompile(`\breplayed\b`).MatchString(line) {
			replayed = line
		}
	}
	require.NotEmpty(t, replayed, "the slog tracer logs the replayed call; it logged:\n%s", logs.String())
	require.NotContains(t, logs.String(), key, "keys are not logged by default")
	require.Contains(t, replayed, "alice", "the line names the key's scope")
	t.Logf("the slog tracer's line for the replayed call: %s", replayed)
}
