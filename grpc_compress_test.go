package idempotency_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	_ "google.golang.org/grpc/encoding/gzip" // registers gzip, which clients then advertise
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// compressionSeen is a client stats handler that records the compression
// of every response header.
type compressionSeen struct {
	mu   sync.Mutex
	seen []string
}

func (c *compressionSeen) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context {
	return ctx
}
func (c *compressionSeen) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return ctx
}
func (c *compressionSeen) HandleConn(context.Context, stats.ConnStats) {}
func (c *compressionSeen) HandleRPC(_ context.Context, s stats.RPCStats) {
	if h, ok := s.(*stats.InHeader); ok && h.IsClient() {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.seen = append(c.seen, h.Compression)
	}
}

// grpc-go's SetSendCompressor and ClientSupportedCompressors work only on
// its own stream type, which a keyed call's handler does not get; the
// package's functions of the same names do, keyed call or not.
func TestGRPCHandlerChoosesItsCompressor(t *testing.T) {
	t.Parallel()
	var grpcErr error
	var e *env
	e = newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if _, keyed := idempotency.TxFromContext(ctx); keyed {
			grpcErr = grpc.SetSendCompressor(ctx, "gzip")
		}
		supported, err := idempotency.ClientSupportedCompressors(ctx)
		if err != nil {
			return nil, err
		}
		if err := idempotency.SetSendCompressor(ctx, "gzip"); err != nil {
			return nil, err
		}
		resp, err := e.insertLedger(ctx, req)
		if err != nil {
			return nil, err
		}
		resp.Value += " " + strings.Join(supported, ",")
		return resp, nil
	}})
	seen := &compressionSeen{}
	conn, err := grpc.NewClient("passthrough:///"+e.addr, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithStatsHandler(seen))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })

	for _, key := range []string{"compress-1", ""} {
		ctx := context.Background()
		if key != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, key)
		}
		r := invoke(ctx, conn, methodCharge, "zip")
		require.NoError(t, r.err, "key %q", key)
		require.Contains(t, r.resp.GetValue(), "gzip", "the client's compressors, seen by the handler")
	}
	require.ErrorContains(t, grpcErr, "failed to fetch the stream", "grpc-go's own function still fails on a keyed call; if it stops failing, the README can say so")
	seen.mu.Lock()
	defer seen.mu.Unlock()
	require.Equal(t, []string{"gzip", "gzip"}, seen.seen, "both responses, keyed or not, were sent with gzip")
	require.Equal(t, 2, e.ledgerRows())
}
