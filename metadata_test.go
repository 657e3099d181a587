package idempotency_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	_ "google.golang.org/grpc/encoding/gzip" // registers gzip, which clients then advertise
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// Headers an interceptor outside the key interceptor already sent cannot
// be added to: a handler's grpc.SetHeader then fails, as it does without
// the interceptor, instead of reporting success and losing the header (and
// storing it for replays that could not send it either). Before the outer
// interceptor sends anything, headers still reach the client.
func TestGRPCHeadersAfterAnOuterInterceptorSentThem(t *testing.T) {
	t.Parallel()
	var setErr error
	var e *env
	outer := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		if req.(*wrapperspb.StringValue).GetValue() == "early" {
			if err := grpc.SendHeader(ctx, metadata.Pairs("x-outer", "1")); err != nil {
				return nil, err
			}
		}
		return next(ctx, req)
	}
	e = newEnv(t, envConfig{interceptors: []grpc.UnaryServerInterceptor{outer}, handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		setErr = grpc.SetHeader(ctx, metadata.Pairs("x-charge-id", "ch-1"))
		if setErr != nil {
			return nil, setErr
		}
		return e.insertLedger(ctx, req)
	}})
	call := func(key, body string) (metadata.MD, error) {
		var header metadata.MD
		ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, key)
		err := e.conn.Invoke(ctx, methodCharge, wrapperspb.String(body), &wrapperspb.StringValue{}, grpc.Header(&header))
		return header, err
	}

	header, err := call("h-early", "early")
	require.Error(t, setErr, "the handler learns that its header cannot be sent")
	require.NotEqual(t, codes.OK, status.Code(err))
	require.Equal(t, []string{"1"}, header.Get("x-outer"))
	require.Empty(t, header.Get("x-charge-id"))
	require.Equal(t, "", e.keyState("h-early"), "nothing stored that a replay could not give")
	require.Zero(t, e.ledgerRows())

	for range 2 { // the first call and its replay
		header, err = call("h-late", "late")
		require.NoError(t, err)
		require.Equal(t, []string{"ch-1"}, header.Get("x-charge-id"))
		require.Len(t, header.Get("content-type"), 1)
	}
	require.Equal(t, 1, e.ledgerRows())
}

// wrappedStream is a ServerTransportStream wrapper, as tracing or logging
// interceptors install to see the headers a call sends.
type wrappedStream struct{ grpc.ServerTransportStream }

// README, Limitations: when an interceptor outside this one wrapped the
// call's ServerTransportStream and sent the headers itself, a handler's
// later grpc.SetHeader on a keyed call cannot be told it is too late: the
// recorder asks grpc-go's own stream whether its headers went, and a
// wrapper hides it. The header is stored with the result and replayed
// (both answers agree), and the first answer lacks it, as the headers had
// gone. This test holds the limitation to what the README says: without
// the key the late SetHeader fails, with it SetHeader returns nil and the
// first answer has no x-charge-id; a replay carries it.
func TestSetHeaderBehindAWrappedStreamIsTheDocumentedLimit(t *testing.T) {
	t.Parallel()
	outer := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		ctx = grpc.NewContextWithServerTransportStream(ctx, wrappedStream{grpc.ServerTransportStreamFromContext(ctx)})
		if err := grpc.SendHeader(ctx, metadata.Pairs("x-outer", "1")); err != nil {
			return nil, err
		}
		return next(ctx, req)
	}
	var setErr error
	e := newEnv(t, envConfig{interceptors: []grpc.UnaryServerInterceptor{outer}, handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		setErr = grpc.SetHeader(ctx, metadata.Pairs("x-charge-id", "ch-1"))
		return wrapperspb.String("ok"), nil
	}})

	// Without the key the interceptor passes the call through: grpc-go's
	// own stream refuses the late header.
	var header metadata.MD
	require.NoError(t, e.conn.Invoke(context.Background(), methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{}, grpc.Header(&header)))
	require.Error(t, setErr, "without the key interceptor's recorder, the late SetHeader fails")

	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "wrapped-1")
	header = nil
	require.NoError(t, e.conn.Invoke(ctx, methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{}, grpc.Header(&header)))
	require.Equal(t, []string{"1"}, header.Get("x-outer"))
	require.NoError(t, setErr, "if this fails, the recorder now sees through the wrapper: drop the README's limitation")
	require.Empty(t, header.Get("x-charge-id"), "the headers had gone before the handler set it")
}

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

// A handler that sends its headers (grpc.SendHeader) and then fails: with a
// final error the client gets the headers and the error, and a retry gets
// both again, marked replayed; with a transient error it gets the headers
// and the error, and the retry runs again and gets its own headers. The
// same with the interceptor chained twice.
func TestHandlerSendsHeadersThenFails(t *testing.T) {
	t.Parallel()
	for _, twice := range []bool{false, true} {
		var e *env
		cfg := envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			n := e.runs.Load()
			if err := grpc.SendHeader(ctx, metadata.Pairs("x-run", string(rune('0'+n)))); err != nil {
				return nil, err
			}
			_ = grpc.SetTrailer(ctx, metadata.Pairs("x-t", req.GetValue()))
			switch {
			case req.GetValue() == "final":
				return nil, status.Error(codes.FailedPrecondition, "declined")
			case req.GetValue() == "flaky" && n == 2:
				return nil, status.Error(codes.Unavailable, "downstream")
			}
			return wrapperspb.String("ok"), nil
		}}
		if twice {
			cfg.interceptors = []grpc.UnaryServerInterceptor{nil}
		}
		e = newEnvNested(t, cfg, twice)
		call := func(key, body string) (metadata.MD, metadata.MD, error) {
			var h, tr metadata.MD
			ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, key)
			err := e.conn.Invoke(ctx, methodCharge, wrapperspb.String(body), &wrapperspb.StringValue{}, grpc.Header(&h), grpc.Trailer(&tr))
			return h, tr, err
		}
		h1, t1, err := call("k-final", "final")
		require.Equal(t, codes.FailedPrecondition, status.Code(err), "twice=%v", twice)
		require.Equal(t, []string{"1"}, h1.Get("x-run"))
		require.Equal(t, []string{"final"}, t1.Get("x-t"))
		h2, t2, err := call("k-final", "final")
		require.Equal(t, codes.FailedPrecondition, status.Code(err))
		require.Equal(t, []string{"1"}, h2.Get("x-run"), "twice=%v: the sent header is replayed", twice)
		require.Equal(t, []string{"final"}, t2.Get("x-t"))
		require.Equal(t, []string{"true"}, t2.Get(idempotency.ReplayedTrailer))

		h3, t3, err := call("k-flaky", "flaky")
		require.Equal(t, codes.Unavailable, status.Code(err), "twice=%v", twice)
		require.Equal(t, []string{"2"}, h3.Get("x-run"))
		require.Equal(t, []string{"flaky"}, t3.Get("x-t"))
		require.Empty(t, t3.Get(idempotency.ReplayedTrailer))
		h4, t4, err := call("k-flaky", "flaky")
		require.NoError(t, err)
		require.Equal(t, []string{"3"}, h4.Get("x-run"), "twice=%v: the retry's own header", twice)
		require.Empty(t, t4.Get(idempotency.ReplayedTrailer))
		require.EqualValues(t, 3, e.runs.Load())
	}
}

// newEnvNested is newEnv, with the key interceptor chained twice when twice.
func newEnvNested(t *testing.T, cfg envConfig, twice bool) *env {
	t.Helper()
	cfg.interceptors = nil
	if !twice {
		return newEnv(t, cfg)
	}
	var e *env
	inner := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		return idempotency.UnaryServerInterceptor(e.store)(ctx, req, info, next)
	}
	cfg.interceptors = []grpc.UnaryServerInterceptor{func(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		return idempotency.UnaryServerInterceptor(e.store)(ctx, req, info, func(ctx context.Context, req any) (any, error) {
			return inner(ctx, req, info, next)
		})
	}}
	e = newEnv(t, cfg)
	return e
}

// An answer that is not this run's (here the engine's error for a handler
// that ended the call's transaction) carries none of the headers and
// trailers the run set.
func TestEngineErrorCarriesNothingOfTheRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if err := grpc.SetHeader(ctx, metadata.Pairs("x-charge-id", "ch_never_happened")); err != nil {
			return nil, err
		}
		if err := grpc.SetTrailer(ctx, metadata.Pairs("x-charge-trailer", "ch_never_happened")); err != nil {
			return nil, err
		}
		_, err := idempotency.MustTxFromContext(ctx).Conn().Exec(ctx, `COMMIT`)
		return wrapperspb.String("mine"), err
	}})
	var header, trailer metadata.MD
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "k")
	err := e.conn.Invoke(ctx, methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{}, grpc.Header(&header), grpc.Trailer(&trailer))
	require.Equal(t, codes.Internal, status.Code(err), "%v", err)
	require.Contains(t, status.Convert(err).Message(), "ended the call's transaction")
	require.Empty(t, header.Get("x-charge-id"), "the run's header")
	require.Empty(t, trailer.Get("x-charge-trailer"))
}

// An error the engine stores for a call (its handler ended the transaction
// on tx.Conn()) is one answer: the first caller gets none of the headers
// its handler set, as no replay does.
func TestStoredEngineErrorIsOneAnswer(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		_ = grpc.SetHeader(ctx, metadata.Pairs("x-charge-id", "ch_123"))
		_ = grpc.SetTrailer(ctx, metadata.Pairs("x-receipt", "r_1"))
		_, err := idempotency.MustTxFromContext(ctx).Conn().Exec(ctx, `COMMIT`)
		return wrapperspb.String("ok"), err
	}})
	var answers [2][2]metadata.MD
	for i := range answers {
		ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "k")
		err := e.conn.Invoke(ctx, methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{}, grpc.Header(&answers[i][0]), grpc.Trailer(&answers[i][1]))
		require.Equal(t, codes.Internal, status.Code(err))
	}
	for i := range answers {
		require.Empty(t, answers[i][0].Get("x-charge-id"), "call %d", i)
		require.Empty(t, answers[i][1].Get("x-receipt"), "call %d", i)
	}
}
