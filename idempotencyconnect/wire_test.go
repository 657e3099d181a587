package idempotencyconnect_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencyconnect"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// A method whose idempotency_level is NO_SIDE_EFFECTS but which the
// option makes MODE_REQUIRED (RequiredDespiteLevel): generated connect
// code marks it NoSideEffects, so a client with WithHTTPGet sends GETs.
// The key goes with the GET and the call runs once; a POST of the same
// key is the same call.
func TestGetOfARequiredMethodRunsOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	ic, err := idempotencyconnect.NewHandlerInterceptor(e.store)
	require.NoError(t, err)
	const proc = "/idempotency.testing.v1.PolicyService/RequiredDespiteLevel"
	var gets atomic.Int64
	mux := http.NewServeMux()
	mux.Handle(proc, connect.NewUnaryHandler(proc, ledgerFn(&runs), connect.WithSchema(method("RequiredDespiteLevel")),
		connect.WithIdempotency(connect.IdempotencyNoSideEffects), connect.WithInterceptors(ic)))
	url := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			gets.Add(1)
		}
		mux.ServeHTTP(w, r)
	}))
	cic, err := idempotencyconnect.NewClientInterceptor()
	require.NoError(t, err)
	getClient := connect.NewClient[testingv1.Request, testingv1.Response](httpClient(t, false), url+proc,
		connect.WithHTTPGet(), connect.WithIdempotency(connect.IdempotencyNoSideEffects), connect.WithInterceptors(cic))
	req := connect.NewRequest(&testingv1.Request{Body: "g"})
	first, err := getClient.CallUnary(context.Background(), req)
	require.NoError(t, err)
	require.EqualValues(t, 1, gets.Load(), "sent as GET")
	key := idempotencyconnect.KeyOf(req)
	require.NotEmpty(t, key)
	again, err := client(t, url, proc, protocols[1], true).CallUnary(context.Background(), keyed(key, "g"))
	require.NoError(t, err)
	require.Equal(t, first.Msg.GetLedgerId(), again.Msg.GetLedgerId())
	require.EqualValues(t, 1, runs.Load())
}

// A request in binary protobuf carrying a field this build does not know
// (a newer client's), and the same request in JSON, which connect decodes
// discarding unknown fields: the same call.
func TestUnknownFieldIsTheSameCallAcrossEncodings(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := mount(t, e.store, ledgerFn(&runs), nil, nil, nil)
	body, err := proto.Marshal(&testingv1.Request{Body: "u"})
	require.NoError(t, err)
	body = protowire.AppendTag(body, 99, protowire.BytesType)
	body = protowire.AppendString(body, "from a newer client")
	post := func(ct string, b []byte) (int, string) {
		req, err := http.NewRequest(http.MethodPost, url+procRequired, bytes.NewReader(b))
		require.NoError(t, err)
		req.Header.Set("Content-Type", ct)
		req.Header.Set(idempotency.HeaderKey, "r32-unknown")
		res, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer res.Body.Close()
		out, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(out)
	}
	code, out := post("application/proto", body)
	require.Equal(t, http.StatusOK, code, out)
	code, out = post("application/json", []byte(`{"body":"u","unknownField":"x"}`))
	require.Equal(t, http.StatusOK, code, "the same call in JSON: %s", out)
	code, out = post("application/json", []byte(`{"amount":"0","body":"u"}`))
	require.Equal(t, http.StatusOK, code, "the same call with a default value spelled out: %s", out)
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, e.ledgerRows())
}

// gzip both ways: a compressed request and response, then an uncompressed
// one with the same key, in each protocol: one call, the same message.
func TestGzipAndPlainOfOneKeyAreOneCall(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := mount(t, e.store, ledgerFn(&runs), nil, nil, []connect.HandlerOption{connect.WithCompressMinBytes(0)})
	ctx := context.Background()
	var first int64
	for i, p := range protocols {
		opts := append([]connect.ClientOption{}, p.opts...)
		if i%2 == 0 {
			opts = append(opts, connect.WithSendGzip(), connect.WithCompressMinBytes(0))
		}
		c := connect.NewClient[testingv1.Request, testingv1.Response](httpClient(t, p.h2c), url+procRequired, opts...)
		resp, err := c.CallUnary(ctx, keyed("r32-gzip", "g"))
		require.NoError(t, err, p.name)
		if i == 0 {
			first = resp.Msg.GetLedgerId()
		}
		require.Equal(t, first, resp.Msg.GetLedgerId(), p.name)
	}
	require.EqualValues(t, 1, runs.Load())
}

// One upstream call, sent first in binary protobuf with a field this build
// does not know (a newer client's), then, after its first run failed
// (Unavailable, the key released) after charging a provider downstream,
// in JSON (which connect decodes without unknown fields). The server
// takes both as the same call (one key, one fingerprint); its re-run must
// send the downstream call with the key the first run sent, so that the
// provider charges once.
//
// A known limit, documented in the README's connect-go section: derived
// keys hash the request as received, unknown fields included, so that a
// deploy that declares a field between a crash and its re-run keeps the
// keys (TestDeployDeclaringAMessageFieldKeepsTheKeys); JSON drops what
// binary keeps, so the two encodings of one request with a field the
// server does not declare derive other keys. Closing it needs the first
// run's digest kept beyond a rolled-back run, or one that both properties
// allow.
func TestRerunInAnotherEncodingSendsTheSameDownstreamKey(t *testing.T) {
	t.Skip("a known limit: a re-run in another encoding of a request with fields the server does not declare derives other downstream keys (README, connect-go)")
	t.Parallel()
	down := newEnv(t)
	dh, downKeys := keysSeen(down.mux)
	downstream := client(t, serve(t, dh), procRequired, protocols[0], false)

	up := newEnv(t)
	var runs atomic.Int64
	url := mount(t, up.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		resp, err := downstream.CallUnary(idempotency.WithEffect(ctx, "charge"), connect.NewRequest(&testingv1.Request{Body: "provider " + req.Msg.GetBody()}))
		if err != nil {
			return nil, err
		}
		if runs.Add(1) == 1 {
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("lost the provider's answer"))
		}
		return connect.NewResponse(&testingv1.Response{Body: resp.Msg.GetBody(), LedgerId: resp.Msg.GetLedgerId()}), nil
	}, nil, nil, nil)

	binary, err := proto.Marshal(&testingv1.Request{Body: "x"})
	require.NoError(t, err)
	binary = protowire.AppendTag(binary, 99, protowire.BytesType)
	binary = protowire.AppendString(binary, "from a newer client")
	post := func(ct string, b []byte) int {
		req, err := http.NewRequest(http.MethodPost, url+procRequired, bytes.NewReader(b))
		require.NoError(t, err)
		req.Header.Set("Content-Type", ct)
		req.Header.Set(idempotency.HeaderKey, "r32-derived")
		res, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer res.Body.Close()
		_, _ = io.ReadAll(res.Body)
		return res.StatusCode
	}
	require.Equal(t, http.StatusServiceUnavailable, post("application/proto", binary), "the first run failed")
	require.Equal(t, http.StatusOK, post("application/json", []byte(`{"body":"x"}`)), "the re-run succeeded")
	keys := downKeys()
	require.Len(t, keys, 2)
	require.Equal(t, 1, down.ledgerRows(), "the provider charged once (downstream keys %v)", keys)
	require.Equal(t, keys[0], keys[1], "the re-run sends the first run's downstream key")
}

// A handler that passes on the error of a downstream connect call as it
// got it (return nil, err): connect marks such an error as one from the
// wire and does not send its metadata (the downstream's response headers)
// to the upstream caller. The replay must not either.
func TestDownstreamErrorPassedOnIsReplayedAsSent(t *testing.T) {
	t.Parallel()
	down := newEnv(t)
	downURL := mount(t, down.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("insufficient funds"))
		ce.Meta().Set("X-Downstream-Internal", "ledger-7")
		return nil, ce
	}, nil, nil, nil)
	up := newEnv(t)
	var runs atomic.Int64
	upURL := mount(t, up.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		dc := client(t, downURL, procNoSideEffects, protocols[1], true)
		resp, err := dc.CallUnary(ctx, connect.NewRequest(req.Msg))
		if err != nil {
			return nil, err // passed on as it came
		}
		return connect.NewResponse(resp.Msg), nil
	}, nil, nil, nil)
	for _, p := range protocols {
		c := client(t, upURL, procRequired, p, true)
		key := "r32b-wire-" + p.name
		_, err1 := c.CallUnary(context.Background(), keyed(key, "w"))
		_, err2 := c.CallUnary(context.Background(), keyed(key, "w"))
		v1, v2 := viewOf(t, err1), viewOf(t, err2)
		require.Equal(t, connect.CodeFailedPrecondition, v1.code, "%s", p.name)
		require.NotContains(t, v1.meta, "x-downstream-internal", "%s: connect does not send a wire error's metadata", p.name)
		require.Equal(t, v1, v2, "%s: the replay", p.name)
	}
	require.EqualValues(t, len(protocols), runs.Load())
}

// A handler calls a downstream service protected by the idempotency layer
// through the client interceptor (a derived key), then fails transiently;
// the client retries, the re-run sends the same derived key, and the
// downstream replays its final error, with the replay marker among the
// error's metadata. The handler passes that error on, as it did the first
// time: the caller must get the downstream's FailedPrecondition, stored
// and replayed, not an Internal error about metadata it cannot store.
func TestDownstreamReplayedFinalErrorPassedOnIsStoredAndReplayed(t *testing.T) {
	t.Parallel()
	down := newEnv(t)
	var downRuns atomic.Int64
	downURL := mount(t, down.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		downRuns.Add(1)
		return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("insufficient funds"))
	}, nil, nil, nil)
	up := newEnv(t)
	var runs atomic.Int64
	upURL := mount(t, up.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		n := runs.Add(1)
		dc := client(t, downURL, procRequired, protocols[1], false)
		_, err := dc.CallUnary(idempotency.WithEffect(ctx, "charge"), connect.NewRequest(req.Msg))
		if n == 1 {
			// The run fails after the downstream answered (its own
			// database hiccuped): the key is released and retried.
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("try again"))
		}
		return nil, err
	}, nil, nil, nil)
	c := client(t, upURL, procRequired, protocols[1], false, idempotency.WithRetryBackoff(time.Millisecond, 5*time.Millisecond))
	_, err := c.CallUnary(context.Background(), connect.NewRequest(&testingv1.Request{Body: "r"}))
	require.Equal(t, connect.CodeFailedPrecondition, connectCode(err), "%v", err)
	require.EqualValues(t, 1, downRuns.Load(), "the downstream ran once")
	require.EqualValues(t, 2, runs.Load())
}
