package idempotencyconnect_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

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
func TestReview32RerunInAnotherEncodingSendsTheSameDownstreamKey(t *testing.T) {
	t.Skip("a known limit: a re-run in another encoding of a request with fields the server does not declare derives other downstream keys (README, connect-go)")
	t.Parallel()
	down := newEnv(t)
	dh, downKeys := keysSeen(down.mux)
	downstream := client(t, serve(t, dh), procRequired, protocols[0], false)

	up := newEnv(t)
	var runs atomic.Int64
	url := r32Mount(t, up.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
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
