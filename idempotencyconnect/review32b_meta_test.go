package idempotencyconnect_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"sort"
	"strings"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// r32bRaw posts a Connect-protocol JSON request of procedure with key, as
// curl or a browser would, and returns the status and the application
// headers of the answer (x-... and trailer-x-..., lower case, sorted, as
// name=values), the replay marker left out.
func r32bRaw(t *testing.T, url, procedure, key, body string) (int, []string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url+procedure, bytes.NewBufferString(`{"body":"`+body+`"}`))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Connect-Protocol-Version", "1")
	req.Header.Set(idempotency.HeaderKey, key)
	resp, err := httpClient(t, false).Do(req)
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	var out []string
	for k, vs := range resp.Header {
		k = strings.ToLower(k)
		if strings.HasPrefix(k, "x-") || strings.HasPrefix(k, "trailer-x-") {
			out = append(out, k+"="+strings.Join(vs, ","))
		}
	}
	sort.Strings(out)
	return resp.StatusCode, out
}

// A final error with metadata, answered in the Connect protocol: connect
// sends an error's metadata as plain response headers. A caller reading
// the answer as HTTP (curl, a browser, a proxy) must find the metadata in
// the same place on the replay.
func TestReview32bFinalErrorMetaKeepsItsPlaceInTheConnectProtocol(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := r32Mount(t, e.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("declined"))
		ce.Meta().Set("X-Decline-Code", "51")
		return nil, ce
	}, nil, nil, nil)
	st1, h1 := r32bRaw(t, url, procRequired, "r32b-raw-meta", "x")
	st2, h2 := r32bRaw(t, url, procRequired, "r32b-raw-meta", "x")
	require.Equal(t, st1, st2)
	require.Equal(t, []string{"x-decline-code=51"}, h1, "the first answer")
	require.Equal(t, h1, h2, "the replay's headers")
	require.EqualValues(t, 1, runs.Load())
}

// An interceptor outside the idempotency interceptor sets a header through
// CallInfo (Vary, a CORS or cache header); the handler adds a value of the
// same header on its connect.Response. connect merges the two: the first
// answer carries both values. The replay must too.
func TestReview32bOuterCallInfoHeaderAndResponseHeaderOfOneName(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	outer := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			info, _ := connect.CallInfoForHandlerContext(ctx)
			info.ResponseHeader().Set("X-Vary", "origin")
			return next(ctx, req)
		}
	})
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		resp, err := ledger(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		r := connect.NewResponse(resp)
		r.Header().Set("X-Vary", "authorization")
		return r, nil
	}
	url := r32Mount(t, e.store, fn, []connect.Interceptor{outer}, nil, nil)
	for _, p := range protocols {
		c := client(t, url, procRequired, p, true)
		key := "r32b-merge-" + p.name
		first, err := c.CallUnary(context.Background(), keyed(key, "m"))
		require.NoError(t, err)
		require.Equal(t, []string{"origin", "authorization"}, first.Header().Values("X-Vary"), "%s: the first answer", p.name)
		again, err := c.CallUnary(context.Background(), keyed(key, "m"))
		require.NoError(t, err)
		require.Equal(t, "true", again.Trailer().Get(idempotency.ReplayedTrailer))
		require.Equal(t, first.Header().Values("X-Vary"), again.Header().Values("X-Vary"), "%s: the replay", p.name)
	}
	require.EqualValues(t, len(protocols), runs.Load())
}

// An interceptor outside sets a header through CallInfo; the handler
// deletes it (the answer must not carry it: a cache header on a charge).
// The first answer has no such header; the replay must have none either.
func TestReview32bHandlerDeletingAnOuterHeader(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	outer := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			info, _ := connect.CallInfoForHandlerContext(ctx)
			info.ResponseHeader().Set("X-Cacheable", "yes")
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
		info.ResponseHeader().Del("X-Cacheable")
		info.ResponseHeader().Set("X-Charged", "1")
		return connect.NewResponse(resp), nil
	}
	url := r32Mount(t, e.store, fn, []connect.Interceptor{outer}, nil, nil)
	c := client(t, url, procRequired, protocols[1], true)
	first, err := c.CallUnary(context.Background(), keyed("r32b-del", "d"))
	require.NoError(t, err)
	require.Empty(t, first.Header().Values("X-Cacheable"), "the first answer")
	require.Equal(t, "1", first.Header().Get("X-Charged"))
	again, err := c.CallUnary(context.Background(), keyed("r32b-del", "d"))
	require.NoError(t, err)
	require.Equal(t, "true", again.Trailer().Get(idempotency.ReplayedTrailer))
	require.Equal(t, "1", again.Header().Get("X-Charged"))
	require.Equal(t, first.Header().Values("X-Cacheable"), again.Header().Values("X-Cacheable"), "the replay")
	require.EqualValues(t, 1, runs.Load())
}

// An interceptor outside the idempotency interceptor strips internal
// headers from the response before it leaves the service (resp.Header(),
// and an error's Meta()). The first answer carries none; a replay of the
// key goes out through the same interceptor and must carry none either.
func TestReview32bOuterInterceptorStrippingResponseHeaders(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	strip := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			resp, err := next(ctx, req)
			if err != nil {
				var ce *connect.Error
				if errors.As(err, &ce) {
					ce.Meta().Del("X-Internal-Shard")
				}
				return nil, err
			}
			resp.Header().Del("X-Internal-Shard")
			return resp, nil
		}
	})
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		if req.Msg.GetBody() == "fail" {
			ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("declined"))
			ce.Meta().Set("X-Internal-Shard", "7")
			return nil, ce
		}
		resp, err := ledger(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		r := connect.NewResponse(resp)
		r.Header().Set("X-Internal-Shard", "7")
		return r, nil
	}
	url := r32Mount(t, e.store, fn, []connect.Interceptor{strip}, nil, nil)
	for _, p := range protocols {
		c := client(t, url, procRequired, p, true)
		key := "r32b-strip-" + p.name
		first, err := c.CallUnary(context.Background(), keyed(key, "ok"))
		require.NoError(t, err)
		require.Empty(t, first.Header().Values("X-Internal-Shard"), "%s: the first answer", p.name)
		again, err := c.CallUnary(context.Background(), keyed(key, "ok"))
		require.NoError(t, err)
		require.Equal(t, "true", again.Trailer().Get(idempotency.ReplayedTrailer))
		assert.Empty(t, again.Header().Values("X-Internal-Shard"), "%s: the replay", p.name)

		_, err1 := c.CallUnary(context.Background(), keyed(key+"-f", "fail"))
		_, err2 := c.CallUnary(context.Background(), keyed(key+"-f", "fail"))
		assert.NotContains(t, r32View(t, err1).meta, "x-internal-shard", "%s: the first error", p.name)
		assert.NotContains(t, r32View(t, err2).meta, "x-internal-shard", "%s: the replayed error", p.name)
	}
	require.EqualValues(t, 2*len(protocols), runs.Load())
}

// A handler that sets the replay marker itself (a copy of a downstream
// answer's headers, or a malicious handler) and fails transiently: the
// attempt was not a replay, so the marker must not reach the client, as
// grpc-go's recorder refuses it (SetTrailer fails, nothing is sent).
func TestReview32bHandlersOwnReplayMarkerOnATransientError(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		ce := connect.NewError(connect.CodeUnavailable, errors.New("busy"))
		switch req.Msg.GetBody() {
		case "info":
			info, _ := connect.CallInfoForHandlerContext(ctx)
			info.ResponseTrailer().Set(idempotency.ReplayedTrailer, "true")
		case "meta":
			ce.Meta().Set(idempotency.ReplayedTrailer, "true")
		}
		return nil, ce
	}
	url := r32Mount(t, e.store, fn, nil, nil, nil)
	for _, body := range []string{"info", "meta"} {
		for _, p := range protocols {
			_, err := client(t, url, procRequired, p, true).CallUnary(context.Background(), keyed("r32b-marker-"+body+p.name, body))
			var ce *connect.Error
			require.True(t, errors.As(err, &ce), "%v", err)
			assert.Equal(t, connect.CodeUnavailable, ce.Code(), "%s %s", body, p.name)
			assert.Empty(t, ce.Meta().Values(idempotency.ReplayedTrailer), "%s %s: an executed attempt marked replayed", body, p.name)
		}
	}
}

// A handler sets a -bin header whose value is not base64 (a mistake the
// client may or may not notice): the replay sends what the first answer
// sent, not another value.
func TestReview32bBinaryHeaderThatIsNotBase64(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := r32Mount(t, e.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		resp, err := ledger(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		r := connect.NewResponse(resp)
		r.Header().Set("X-Trace-Bin", "v=1;not*base64")
		return r, nil
	}, nil, nil, nil)
	st1, h1 := r32bRaw(t, url, procRequired, "r32b-notb64", "b")
	st2, h2 := r32bRaw(t, url, procRequired, "r32b-notb64", "b")
	require.Equal(t, http.StatusOK, st1)
	require.Equal(t, st1, st2)
	require.Equal(t, []string{"x-trace-bin=v=1;not*base64"}, h1)
	require.Equal(t, h1, h2, "the replay")
	require.EqualValues(t, 1, runs.Load())
}
