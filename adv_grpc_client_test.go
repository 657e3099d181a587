package idempotency_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// README, Server: gRPC's infrastructure services "always pass through,
// keyed or not, and the client interceptor sends them no key"; the binary
// key is refused "on protected methods". The client interceptor refuses a
// binary key, or a text key it finds invalid, in the outgoing metadata of
// every method, health checks included, before looking at the method's
// policy: a health probe or a NO_SIDE_EFFECTS read made from a context
// that carries forwarded metadata (a proxy, a handler passing its incoming
// metadata on) fails on the client with InvalidArgument, where the server
// would answer it, keys ignored.
//
// Correct: calls the server passes through whatever their keys are pass
// the client interceptor too (their keys ignored or stripped).
func TestAdvClientPassesInfrastructureCallsWhateverTheKey(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(store, idempotency.WithKeyRequired())))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	addr := serve(t, srv)
	plain := dial(t, addr)
	keyed := dialWith(t, addr, grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1))))

	for _, pairs := range [][]string{
		{idempotency.MetadataKey + "-bin", "forwarded"},
		{idempotency.MetadataKey, "not a valid key"},
	} {
		ctx := metadata.AppendToOutgoingContext(context.Background(), pairs...)
		_, err := healthpb.NewHealthClient(plain).Check(ctx, &healthpb.HealthCheckRequest{})
		require.NoError(t, err, "the server passes the health check with %v", pairs)
		_, err = healthpb.NewHealthClient(keyed).Check(ctx, &healthpb.HealthCheckRequest{})
		require.NotEqual(t, codes.InvalidArgument, status.Code(err), "the client interceptor refuses a health check carrying %v: %v", pairs, err)
	}
}
