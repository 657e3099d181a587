package idempotency_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// The README's quickstarts, as code the README's blocks are copies of, and
// the tests that run them. The HTTP one is here; the gRPC one, with the
// store it shares, is in quickstart_grpc_test.go.

// callerKey is where the authentication of the quickstarts puts the caller
// it verified.
type callerKey struct{}

// quickstartTokens are the quickstarts' callers, by bearer token.
var quickstartTokens = map[string]string{"token-alice": "alice", "token-bob": "bob"}

// verifiedCaller is the caller that the authentication in front verified:
// the scope of its keys.
func verifiedCaller(ctx context.Context) (string, error) {
	if who, ok := ctx.Value(callerKey{}).(string); ok {
		return who, nil
	}
	return "", status.Error(codes.Unauthenticated, "no verified caller")
}

// authenticateHTTP stands for a service's own authentication middleware.
func authenticateHTTP(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		who, ok := quickstartTokens[strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")]
		if !ok {
			http.Error(w, "unknown caller", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), callerKey{}, who)))
	})
}

// createTransfer records a transfer through the request's transaction: the
// row and the stored response commit together, or not at all.
func createTransfer(w http.ResponseWriter, r *http.Request) {
	var t struct {
		From, To string
		Cents    int64
	}
	if err := json.NewDecoder(r.Body).Decode(&t); err != nil {
		http.Error(w, "not a transfer", http.StatusBadRequest) // not stored: the corrected request may reuse the key
		return
	}
	tx := idempotency.MustTxFromContext(r.Context()) // the request's transaction
	var id int64
	err := tx.QueryRow(r.Context(), `INSERT INTO transfers (from_account, to_account, cents) VALUES ($1, $2, $3) RETURNING id`,
		t.From, t.To, t.Cents).Scan(&id)
	if err != nil {
		http.Error(w, "try again", http.StatusServiceUnavailable) // 5xx: not stored, the key released
		return
	}
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, "{\"transfer_id\":%d}\n", id)
}

// quickstartHTTP is the README's HTTP quickstart: the middleware on a
// route, with a scope per caller, behind the service's authentication.
func quickstartHTTP(store *idempotency.Store) *http.Server {
	// Each caller's keys are their own: the scope is the caller your
	// authentication verified (never the token, which may change between
	// a request and its retry).
	protect := idempotency.HTTPMiddleware(store, idempotency.WithHTTPScope(func(r *http.Request) (string, error) {
		return verifiedCaller(r.Context())
	}))
	mux := http.NewServeMux()
	mux.Handle("POST /v1/transfers", protect(http.HandlerFunc(createTransfer)))
	srv := &http.Server{
		Addr:              ":8080",
		Handler:           authenticateHTTP(mux), // yours: puts the verified caller in the context
		ReadHeaderTimeout: 10 * time.Second,
	}
	return srv
}

// The HTTP quickstart, served over a socket: a retry with the key gets the
// first response back, byte for byte, and writes nothing; another caller's
// request with the same key is its own; the key with another body is
// refused with 422.
func TestQuickstartHTTPReplaysARequest(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `CREATE TABLE transfers (id bigserial PRIMARY KEY, from_account text, to_account text, cents bigint)`)
	require.NoError(t, err)
	store, err := idempotency.NewStore(db.Pool)
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx))
	srv := httptest.NewServer(quickstartHTTP(store).Handler)
	defer srv.Close()

	post := func(token, key, body string) (int, http.Header, string) {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/transfers", strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+token)
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, resp.Header, string(b)
	}
	const transfer = `{"From": "acct-1", "To": "acct-2", "Cents": 500}`

	code, _, first := post("token-alice", "transfer-1", transfer)
	require.Equal(t, http.StatusOK, code, first)
	code, header, again := post("token-alice", "transfer-1", transfer)
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, first, again, "the retry gets the first response, byte for byte")
	require.Equal(t, "true", header.Get(idempotency.ReplayedHeader))
	t.Logf("alice's first response and its replay: %s", strings.TrimSpace(again))

	code, _, bobs := post("token-bob", "transfer-1", transfer)
	require.Equal(t, http.StatusOK, code)
	require.NotEqual(t, first, bobs, "bob's key is his own")

	code, _, reused := post("token-alice", "transfer-1", `{"From": "acct-1", "To": "acct-2", "Cents": 900}`)
	require.Equal(t, http.StatusUnprocessableEntity, code, reused)

	require.Equal(t, 2, db.Count(t, `SELECT count(*) FROM transfers`), "alice's transfer and bob's, once each")
}
