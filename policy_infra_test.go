package idempotency_test

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	channelzpb "google.golang.org/grpc/channelz/grpc_channelz_v1"
	channelzsvc "google.golang.org/grpc/channelz/service"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/reflection"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	reflectionv1alphapb "google.golang.org/grpc/reflection/grpc_reflection_v1alpha"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// Issue item 9: with the README's set-up (WithKeyRequired), gRPC's own
// services (health checks from Kubernetes probes, grpc_health_probe and
// Envoy; reflection; channelz) pass untouched, keyed or not, and the client
// interceptor sends them no key; methods whose idempotency_level says they
// are safe pass too. The services are grpc-go's own, on a real server.
func TestPolicyInfrastructureServicesNeedNoKey(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	createLedger(t, db)

	var mu sync.Mutex
	sentKeys := map[string][]string{} // the keys each method arrived with
	record := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		mu.Lock()
		sentKeys[info.FullMethod] = append(sentKeys[info.FullMethod], metadata.ValueFromIncomingContext(ctx, idempotency.MetadataKey)...)
		mu.Unlock()
		return handler(ctx, req)
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(record, idempotency.UnaryServerInterceptor(store, idempotency.WithKeyRequired())))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	reflection.Register(srv)
	channelzsvc.RegisterChannelzServiceToServer(srv)
	testingv1.RegisterPolicyServiceServer(srv, &policyServer{db: db})
	addr := serve(t, srv)
	plain := dial(t, addr)
	keyed := dialWith(t, addr, grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1))))

	withKey := func(key string) context.Context {
		if key == "" {
			return context.Background()
		}
		return metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, key)
	}

	for _, key := range []string{"", "probe-key", "not a valid key"} {
		ctx := withKey(key)
		resp, err := healthpb.NewHealthClient(plain).Check(ctx, &healthpb.HealthCheckRequest{})
		require.NoError(t, err, "health Check with key %q", key)
		require.Equal(t, healthpb.HealthCheckResponse_SERVING, resp.GetStatus())
		list, err := healthpb.NewHealthClient(plain).List(ctx, &healthpb.HealthListRequest{})
		require.NoError(t, err, "health List with key %q", key)
		require.Contains(t, list.GetStatuses(), "")
		servers, err := channelzpb.NewChannelzClient(plain).GetServers(ctx, &channelzpb.GetServersRequest{})
		require.NoError(t, err, "channelz GetServers with key %q", key)
		require.NotEmpty(t, servers.GetServer())
	}
	require.Equal(t, 0, db.Count(t, `SELECT count(*) FROM idempotency_keys`), "nothing stored for infrastructure calls")

	t.Run("the client interceptor sends health checks no key", func(t *testing.T) {
		mu.Lock()
		delete(sentKeys, healthpb.Health_Check_FullMethodName)
		mu.Unlock()
		_, err := healthpb.NewHealthClient(keyed).Check(context.Background(), &healthpb.HealthCheckRequest{})
		require.NoError(t, err)
		mu.Lock()
		defer mu.Unlock()
		require.Empty(t, sentKeys[healthpb.Health_Check_FullMethodName])
	})

	t.Run("reflection v1 and v1alpha answer", func(t *testing.T) {
		ctx := withKey("reflect-key")
		v1, err := reflectionpb.NewServerReflectionClient(plain).ServerReflectionInfo(ctx)
		require.NoError(t, err)
		require.NoError(t, v1.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}))
		got, err := v1.Recv()
		require.NoError(t, err)
		require.NotEmpty(t, got.GetListServicesResponse().GetService())
		require.NoError(t, v1.CloseSend())

		alpha, err := reflectionv1alphapb.NewServerReflectionClient(plain).ServerReflectionInfo(ctx)
		require.NoError(t, err)
		require.NoError(t, alpha.Send(&reflectionv1alphapb.ServerReflectionRequest{MessageRequest: &reflectionv1alphapb.ServerReflectionRequest_ListServices{}}))
		gotAlpha, err := alpha.Recv()
		require.NoError(t, err)
		require.NotEmpty(t, gotAlpha.GetListServicesResponse().GetService())
		require.NoError(t, alpha.CloseSend())
	})

	t.Run("safe idempotency_level passes, the others still need a key", func(t *testing.T) {
		c := testingv1.NewPolicyServiceClient(plain)
		for _, m := range []rpc{c.NoSideEffects, c.Idempotent} {
			_, replayed, err := send(m, "", &testingv1.Request{Body: "safe"})
			require.NoError(t, err)
			require.False(t, replayed)
		}
		require.Equal(t, 2, db.Count(t, `SELECT count(*) FROM ledger WHERE note = 'safe'`))
		_, _, err := send(c.Unannotated, "", &testingv1.Request{Body: "unsafe"})
		require.Equal(t, idempotency.MetadataKey, badRequestField(t, err), "WithKeyRequired is in force")
	})
}
