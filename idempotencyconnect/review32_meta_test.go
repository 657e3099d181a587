package idempotencyconnect_test

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// An interceptor outside the idempotency interceptor sets a default
// response header; the handler replaces it (Set) through CallInfo. The
// first caller gets the handler's value; so must the replay.
func TestReview32HandlerReplacingAnOuterHeaderIsReplayed(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	outer := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			if info, ok := connect.CallInfoForHandlerContext(ctx); ok {
				info.ResponseHeader().Set("Cache-Control", "no-store")
			}
			return next(ctx, req)
		}
	})
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		resp, err := ledger(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		info, _ := connect.CallInfoForHandlerContext(ctx)
		info.ResponseHeader().Set("Cache-Control", "private, max-age=60")
		return connect.NewResponse(resp), nil
	}
	url := r32Mount(t, e.store, fn, []connect.Interceptor{outer}, nil, nil)
	ctx := context.Background()
	c := client(t, url, procRequired, protocols[0], true)
	first, err := c.CallUnary(ctx, keyed("r32-replace", "r"))
	require.NoError(t, err)
	require.Equal(t, []string{"private, max-age=60"}, first.Header().Values("Cache-Control"))
	again, err := c.CallUnary(ctx, keyed("r32-replace", "r"))
	require.NoError(t, err)
	require.Equal(t, "true", again.Trailer().Get(idempotency.ReplayedTrailer))
	require.Equal(t, first.Header().Values("Cache-Control"), again.Header().Values("Cache-Control"), "the replay carries the header the first answer carried")
	require.EqualValues(t, 1, runs.Load())
}

// r32MD is a metadata's application keys (x-...), sorted, as k=v.
func r32MD(md metadata.MD) []string {
	var out []string
	for k, vs := range md {
		if strings.HasPrefix(k, "x-") {
			out = append(out, k+"="+strings.Join(vs, ","))
		}
	}
	sort.Strings(out)
	return out
}

// A connect handler sets a header and a trailer through CallInfo and fails
// with a final error carrying metadata; a grpc-go client calls it twice
// with one key. gRPC tells headers from trailers: the replay puts each
// where the first answer had it.
func TestReview32FinalErrorHeadersAndTrailersKeepTheirPlaceForGRPCClients(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		info, _ := connect.CallInfoForHandlerContext(ctx)
		info.ResponseHeader().Set("X-Info-Header", "h")
		info.ResponseTrailer().Set("X-Info-Trailer", "t")
		ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("declined"))
		ce.Meta().Set("X-Decline-Code", "51")
		return nil, ce
	}
	url := r32Mount(t, e.store, fn, nil, nil, nil)
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "r32-place")
	gc := grpcClient(t, url)
	var h1, t1, h2, t2 metadata.MD
	_, err := gc.Required(ctx, &testingv1.Request{Body: "x"}, grpc.Header(&h1), grpc.Trailer(&t1))
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	_, err = gc.Required(ctx, &testingv1.Request{Body: "x"}, grpc.Header(&h2), grpc.Trailer(&t2))
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	require.Equal(t, []string{"true"}, t2.Get(idempotency.ReplayedTrailer))
	require.Equal(t, r32MD(h1), r32MD(h2), "headers: first %v, replay %v (trailers: first %v, replay %v)", r32MD(h1), r32MD(h2), r32MD(t1), r32MD(t2))
	require.Equal(t, r32MD(t1), r32MD(t2), "trailers: first %v, replay %v", r32MD(t1), r32MD(t2))
	require.EqualValues(t, 1, runs.Load())
}

// The same across frameworks: a grpc-go handler sets a header and fails
// with a final error; the replay through the connect handler puts the
// header where the grpc-go server put it.
func TestReview32FinalErrorHeaderFromGRPCServerKeepsItsPlaceOnConnect(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(e.store)))
	testingv1.RegisterPolicyServiceServer(srv, r32Work{work: func(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
		runs.Add(1)
		_ = grpc.SetHeader(ctx, metadata.Pairs("x-info-header", "h"))
		_ = grpc.SetTrailer(ctx, metadata.Pairs("x-info-trailer", "t"))
		return nil, status.Error(codes.FailedPrecondition, "declined")
	}})
	lis := listen(t)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	connectURL := r32Mount(t, e.store, func(context.Context, *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		t.Error("the connect handler ran")
		return nil, errors.New("must not run")
	}, nil, nil, nil)
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "r32-place-2")
	var h1, t1, h2, t2 metadata.MD
	_, err := grpcClient(t, "http://"+lis.Addr().String()).Required(ctx, &testingv1.Request{Body: "x"}, grpc.Header(&h1), grpc.Trailer(&t1))
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	_, err = grpcClient(t, connectURL).Required(ctx, &testingv1.Request{Body: "x"}, grpc.Header(&h2), grpc.Trailer(&t2))
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	require.Equal(t, []string{"true"}, t2.Get(idempotency.ReplayedTrailer))
	require.Equal(t, r32MD(h1), r32MD(h2), "headers: first %v, replay %v (trailers: first %v, replay %v)", r32MD(h1), r32MD(h2), r32MD(t1), r32MD(t2))
	require.Equal(t, r32MD(t1), r32MD(t2), "trailers: first %v, replay %v", r32MD(t1), r32MD(t2))
	require.EqualValues(t, 1, runs.Load())
}

// A connect handler's final error with metadata (connect's gRPC protocol
// sends an error's metadata as trailers), then its replay through a
// grpc-go server with UnaryServerInterceptor on the same store: a grpc-go
// client finds the metadata where the first answer had it.
func TestReview32FinalErrorMetaFromConnectKeepsItsPlaceOnGRPCServer(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := r32Mount(t, e.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("declined"))
		ce.Meta().Set("X-Decline-Code", "51")
		return nil, ce
	}, nil, nil, nil)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(e.store)))
	testingv1.RegisterPolicyServiceServer(srv, r32Work{work: func(context.Context, *testingv1.Request) (*testingv1.Response, error) {
		t.Error("the grpc-go handler ran")
		return nil, errors.New("must not run")
	}})
	lis := listen(t)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "r32-place-3")
	var h1, t1, h2, t2 metadata.MD
	_, err := grpcClient(t, url).Required(ctx, &testingv1.Request{Body: "x"}, grpc.Header(&h1), grpc.Trailer(&t1))
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	_, err = grpcClient(t, "http://"+lis.Addr().String()).Required(ctx, &testingv1.Request{Body: "x"}, grpc.Header(&h2), grpc.Trailer(&t2))
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	require.Equal(t, []string{"true"}, t2.Get(idempotency.ReplayedTrailer))
	require.Equal(t, r32MD(t1), r32MD(t2), "trailers: first %v, replay %v (headers: first %v, replay %v)", r32MD(t1), r32MD(t2), r32MD(h1), r32MD(h2))
	require.Equal(t, r32MD(h1), r32MD(h2), "headers: first %v, replay %v", r32MD(h1), r32MD(h2))
	require.EqualValues(t, 1, runs.Load())
}

// Runs of the handler whose answer the engine replaces with its own error
// (the handler ended the call's transaction; the handler's database
// session died under it): the headers the run set, through CallInfo and on
// its response, are not sent with that error, nor with its replay.
func TestReview32EngineErrorsCarryNoHeadersOfTheRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		info, _ := connect.CallInfoForHandlerContext(ctx)
		info.ResponseHeader().Set("X-Leak-Info", "1")
		info.ResponseTrailer().Set("X-Leak-Trailer", "1")
		tx := idempotency.MustTxFromContext(ctx)
		switch req.Msg.GetBody() {
		case "commit":
			_, _ = tx.Exec(ctx, "COMMIT")
		case "die":
			_, _ = tx.Exec(ctx, "SELECT pg_terminate_backend(pg_backend_pid())")
		}
		r := connect.NewResponse(&testingv1.Response{Body: "ok"})
		r.Header().Set("X-Leak-Resp", "1")
		return r, nil
	}
	url := r32Mount(t, e.store, fn, nil, nil, nil)
	for _, body := range []string{"commit", "die"} {
		for _, p := range protocols {
			c := client(t, url, procRequired, p, true)
			for i := range 2 {
				_, err := c.CallUnary(context.Background(), keyed("r32-leak-"+body+p.name, body))
				require.Error(t, err, "%s %s %d", body, p.name, i)
				v := r32View(t, err)
				for k := range v.meta {
					require.False(t, strings.HasPrefix(k, "x-leak"), "%s %s %d: %s sent with %v", body, p.name, i, k, err)
				}
			}
		}
	}
}

// An interceptor outside the idempotency interceptor (an auth or audit
// interceptor, placed first as the docs ask) that reads the response
// message by its type: it sees the first answer's message and must see
// the replay's the same way, or the replay differs from the first answer.
//
// A known limit, documented on NewHandlerInterceptor: a replay's response
// holds the stored message behind a wrapper (a connect.Response's type is
// fixed at compile time, and a replay may be answered by a process that
// never ran the method); an interceptor outside reads it as a
// proto.Message, or goes inside.
func TestReview32OuterInterceptorSeesTheReplayByItsType(t *testing.T) {
	t.Skip("a known limit: an interceptor outside sees a replay's message behind a wrapper type (NewHandlerInterceptor's doc)")
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	audit := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			resp, err := next(ctx, req)
			if err != nil {
				return nil, err
			}
			m, ok := resp.Any().(*testingv1.Response)
			if !ok {
				return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("audit: unexpected response %T", resp.Any()))
			}
			resp.Header().Set("X-Audited-Ledger", fmt.Sprint(m.GetLedgerId()))
			return resp, nil
		}
	})
	url := r32Mount(t, e.store, r32Ledger(&runs), []connect.Interceptor{audit}, nil, nil)
	c := client(t, url, procRequired, protocols[1], true)
	first, err := c.CallUnary(context.Background(), keyed("r32-audit", "a"))
	require.NoError(t, err)
	again, err := c.CallUnary(context.Background(), keyed("r32-audit", "a"))
	require.NoError(t, err, "the replay through the same interceptors")
	require.Equal(t, first.Header().Get("X-Audited-Ledger"), again.Header().Get("X-Audited-Ledger"))
	require.EqualValues(t, 1, runs.Load())
}
