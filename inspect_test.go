package idempotency_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// storedHTTPMetadata encodes an HTTP response's status, headers and
// trailers as the middleware stores them (field 1 the status, 2 each
// header, 3 each trailer: a name, then its values).
func storedHTTPMetadata(status int, header, trailer [][]string) []byte {
	b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), uint64(status))
	for _, part := range []struct {
		num     protowire.Number
		entries [][]string
	}{{2, header}, {3, trailer}} {
		for _, e := range part.entries {
			entry := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), e[0])
			for _, v := range e[1:] {
				entry = protowire.AppendString(protowire.AppendTag(entry, 2, protowire.BytesType), v)
			}
			b = protowire.AppendBytes(protowire.AppendTag(b, part.num, protowire.BytesType), entry)
		}
	}
	return b
}

// A record the middleware's first version stored, with the response's
// Set-Cookie and WWW-Authenticate among its headers: Inspect shows the
// headers a replay sends, which are none of those, and the same as the
// replay's.
func TestInspectShowsNoHeaderAReplayOmits(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	store := migratedStore(t, db)
	ctx := context.Background()
	h := idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":"ch_1"}`)
	}))
	send := func() *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/v1/charges", strings.NewReader(`{"amount":100}`))
		req.Header.Set(idempotency.HeaderKey, "order-1")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}
	require.Equal(t, http.StatusCreated, send().Code)
	// What the first version stored: every header, cookies included.
	_, err := db.Pool.Exec(ctx, `UPDATE idempotency_keys SET metadata = $1 WHERE key = 'http order-1'`, storedHTTPMetadata(http.StatusCreated,
		[][]string{{"Content-Type", "application/json"}, {"Location", "/v1/charges/ch_1"}, {"Set-Cookie", "session=first-caller; HttpOnly"},
			{"Www-Authenticate", `Bearer realm="first"`}},
		[][]string{{"Set-Cookie", "late=first-caller"}}))
	require.NoError(t, err)

	rec, err := store.Inspect(ctx, "", "order-1")
	require.NoError(t, err)
	code, header, body, ok := rec.HTTPResponse()
	require.True(t, ok)
	require.Equal(t, http.StatusCreated, code)
	require.Equal(t, `{"id":"ch_1"}`, string(body))
	require.Equal(t, http.Header{"Content-Type": {"application/json"}, "Location": {"/v1/charges/ch_1"}}, header)
	require.Nil(t, rec.HTTPTrailer())

	replay := send()
	require.Equal(t, "true", replay.Header().Get(idempotency.ReplayedHeader))
	require.Empty(t, replay.Result().Cookies(), "the replay sends no cookie")
	sent := replay.Header().Clone()
	sent.Del(idempotency.ReplayedHeader)
	sent.Del("Content-Length")
	require.Equal(t, header, sent, "Inspect's headers are the replay's")
}
